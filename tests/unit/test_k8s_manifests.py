"""The KubeRay manifests in k8s/, checked without a Kubernetes cluster: each validates against
the KubeRay ray.io/v1 CRD schema (vendored in tests/data/kuberay/) with no field the API server
would prune; each serveConfigV2 passes Ray Serve's config schema and ClusterConfig and serves
the same application as its deployments/*.yaml twin; the worker groups hold the CPUs the
replicas ask Ray for, and the GPUs; the Ray version matches the Dockerfiles' base images. The checker itself
is shown to reject broken manifests, so a pass means something."""

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from raycluster.cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = ROOT / "tests" / "data" / "kuberay"
# manifest -> the Serve config whose application it serves
TWINS = {"rayservice.yaml": "mixed.yaml", "rayservice-pd.yaml": "pd.yaml", "rayservice-pd-gpu.yaml": "pd-gpu.yaml",
         "rayservice-spp-nodes-gpu.yaml": "spp-nodes-gpu.yaml"}
GATEWAY_CPUS = 0.5     # deployments/app.py: the gateway replica's ray_actor_options


def schema(kind: str) -> dict:
    return json.loads((SCHEMAS / f"{kind.lower()}.v1.schema.json").read_text())


def pruned_fields(doc, node: dict, path: str = "") -> list[str]:
    """Paths in `doc` that a structural schema does not declare: the API server drops them
    silently (kubectl --validate=strict would refuse them), so a typo there is lost config."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(doc, dict):
        props, extra = node.get("properties"), node.get("additionalProperties")
        for k, v in doc.items():
            if props is not None and k in props:
                out += pruned_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += pruned_fields(v, extra, f"{path}.{k}")
            elif props is not None or extra is False:
                out.append(f"{path}.{k}")
    elif isinstance(doc, list) and "items" in node:
        for i, v in enumerate(doc):
            out += pruned_fields(v, node["items"], f"{path}[{i}]")
    return out


def problems(manifest: dict) -> list[str]:
    """What the API server would reject or drop: schema errors plus pruned fields."""
    s = schema(manifest.get("kind", ""))
    errs = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(s).iter_errors(manifest)]
    return errs + [f"{p}: unknown field" for p in pruned_fields(manifest, s)]


def manifests() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def cluster_spec(m: dict) -> dict:
    return m["spec"]["rayClusterConfig"] if m["kind"] == "RayService" else m["spec"]


def cpus(quantity: str) -> float:
    """A Kubernetes CPU quantity ("4", "500m") in cores."""
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_every_manifest_is_found_and_typed():
    names = [p.name for p in manifests()]
    assert set(TWINS) <= set(names) and "raycluster.yaml" in names
    for p in manifests():
        m = load(p)
        assert m["apiVersion"] == "ray.io/v1" and m["kind"] in ("RayService", "RayCluster"), p.name


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_matches_the_kuberay_crd_schema(path):
    assert problems(load(path)) == []


def test_the_checker_rejects_what_the_api_server_would():
    good = load(K8S / "rayservice.yaml")
    assert problems(good) == []
    bad_type = copy.deepcopy(good)       # rayStartParams values must be strings
    bad_type["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert any("rayStartParams.num-cpus" in e for e in problems(bad_type))
    typo = copy.deepcopy(good)           # would be pruned: the workers never get it
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    assert problems(typo) == [".spec.rayClusterConfig.workerGroupSpecs[0].maxReplica: unknown field"]
    missing = copy.deepcopy(good)        # groupName is required
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in problems(missing))


@pytest.mark.parametrize("name", sorted(TWINS))
def test_serve_config_is_valid_and_serves_the_deployments_app(name):
    serve_cfg = yaml.safe_load(load(K8S / name)["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_cfg)
    # In a pod the proxy must listen beyond loopback, or the Service cannot reach it.
    assert serve_cfg["http_options"]["host"] == "0.0.0.0"
    twin = yaml.safe_load((ROOT / "deployments" / TWINS[name]).read_text())
    assert serve_cfg["proxy_location"] == twin["proxy_location"]
    strip = lambda app: {k: v for k, v in app.items() if k != "deployments"}  # noqa: E731
    assert [strip(a) for a in serve_cfg["applications"]] == twin["applications"]
    for app in serve_cfg["applications"]:
        ClusterConfig(**app["args"])


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_every_ray_container_reads_the_api_key_from_an_optional_secret(path):
    """The gateway replicas read RAYCLUSTER_API_KEY from their pod's environment, wherever Ray
    places them; without the Secret the cluster still starts (and serves without a key)."""
    rc = cluster_spec(load(path))
    groups = [rc["headGroupSpec"], *rc["workerGroupSpecs"]]
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            ref = env["RAYCLUSTER_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "raycluster-api-key", "key": "key", "optional": True}, (path.name, c["name"])


def ranks(cfg: ClusterConfig, pool) -> int:
    """Bundles a replica of `pool` reserves: one per rank of the group it leads, else its own."""
    return len(cfg.placement_bundles(pool) or [None])


@pytest.mark.parametrize("name", sorted(TWINS))
def test_worker_groups_hold_the_cpus_the_replicas_ask_for(name):
    m = load(K8S / name)
    app = yaml.safe_load(m["spec"]["serveConfigV2"])["applications"][0]
    cfg = ClusterConfig(**app["args"])
    replicas = {f"pool-{p.role}": p.instances for p in cfg.pools}
    replicas.update({d["name"]: d["num_replicas"] for d in app.get("deployments", [])})
    by_pool = {f"pool-{p.role}": p.num_cpus * ranks(cfg, p) for p in cfg.pools}
    asked = sum(n * by_pool[d] for d, n in replicas.items()) + GATEWAY_CPUS * cfg.gateway_replicas
    rc = cluster_spec(m)
    # The head runs with num-cpus 0: Ray places every replica on the workers.
    assert rc["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"
    have = sum(g["replicas"] * cpus(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
               for g in rc["workerGroupSpecs"])
    assert asked <= have, f"{name}: replicas ask for {asked} CPUs, workers have {have}"


@pytest.mark.parametrize("name", sorted(TWINS))
def test_worker_groups_hold_the_gpus_the_replicas_ask_for(name):
    m = load(K8S / name)
    cfg = ClusterConfig(**yaml.safe_load(m["spec"]["serveConfigV2"])["applications"][0]["args"])
    asked = sum(p.instances * p.num_gpus * ranks(cfg, p) for p in cfg.pools)
    groups = cluster_spec(m)["workerGroupSpecs"]
    gpus = [float(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
            for g in groups]
    have = sum(g["replicas"] * n for g, n in zip(groups, gpus))
    assert asked <= have, f"{name}: replicas ask for {asked} GPUs, workers have {have}"
    # One GPU per instance: a worker pod must hold at least one instance's share.
    assert all(n >= max(p.num_gpus for p in cfg.pools) for n in gpus if n), name
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == ({"raycluster-gpu:0.1.0"} if asked else {"raycluster:0.1.0"}), (name, images)


def test_ray_version_is_the_images():
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        base = re.search(r"^FROM rayproject/ray:(\S+?)-py311", (K8S / dockerfile).read_text(), re.M)
        assert base, f"k8s/{dockerfile} must build FROM a rayproject/ray:<version>-py311 image"
        for p in manifests():
            assert cluster_spec(load(p))["rayVersion"] == base.group(1), (dockerfile, p.name)
