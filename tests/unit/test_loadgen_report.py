"""`loadgen report`: side-by-side table of 2+ files, sweep files, and the --plot PNG."""

import json

import numpy as np

from loadgen.cli import main
from loadgen.metrics import RequestRecord, build_results
from loadgen.report import load_results, render_table


def fake_results(seed: int, qps: float, scale: float) -> dict:
    """Results of a fake run: long requests 5% with 20x the TTFT, latency growing with `scale`."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(300):
        klass = "long" if i % 20 == 0 else "short"
        a = i / qps
        ttft = rng.lognormal(np.log(0.2 * scale * (20 if klass == "long" else 1)), 0.6)
        n = 20
        recs.append(RequestRecord(f"r{i}", a, a, a + ttft, a + ttft + 0.03 * scale * (n - 1), n,
                                  klass=klass, tenant="A" if i % 3 else "B", ttft_slo_ms=1000.0,
                                  tpot_slo_ms=50.0, prompt_tokens=100))
    return build_results(recs, {"source": "test", "workload": "long-mix", "qps": qps})


def write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def test_table_for_two_files_shows_both_columns_and_stored_numbers(tmp_path, capsys):
    a = write(tmp_path / "fcfs.json", fake_results(0, 2.0, 1.0))
    b = write(tmp_path / "lars.json", fake_results(1, 2.0, 0.5))
    assert main(["report", a, b]) == 0
    out = capsys.readouterr().out
    header, sep, *rows = out.strip().splitlines()
    assert header.split() == ["metric", "fcfs", "lars"]
    row = {r.split()[0]: r.split()[1:] for r in rows}
    res = json.loads(open(a).read())
    assert row["ttft_p99_s"][0] == f"{res['summary']['ttft_p99_s']:.3f}"
    assert row["completed"] == ["300", "300"]
    assert "long.ttft_p99_s" in row and "short.slo_attainment" in row and "tenant_fairness_jain" in row


def test_sweep_and_plot_png(tmp_path, capsys):
    runs = [fake_results(int(q), q, s) for q, s in ((1.0, 0.5), (2.0, 1.0), (4.0, 3.0))]
    sweep = write(tmp_path / "sweep.json", {"meta": {"kind": "sweep", "qps": [1, 2, 4]}, "runs": runs})
    single = write(tmp_path / "single.json", fake_results(9, 2.0, 0.7))
    cols = load_results(sweep)
    assert [c[0] for c in cols] == ["sweep@1.0", "sweep@2.0", "sweep@4.0"]
    assert "sweep@4.0" in render_table(cols)
    png = tmp_path / "fig.png"
    assert main(["report", single, sweep, "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
