"""Shared fixtures: the tiny checkpoint, written once per session. gloo binds loopback in every
test (tests never leave the machine), here and in every process a test starts."""

import os
import sys

import pytest

# Make the repo's top-level packages (raycluster, kernels) importable under plain `pytest` too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ["GLOO_SOCKET_IFNAME"] = "lo"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from raycluster.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def loaded(tiny_model_dir):
    """(model, tokenizer) of the tiny checkpoint, loaded once for the modules that only read them."""
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer

    model, mcfg = load_model(tiny_model_dir)
    return model, Tokenizer(tiny_model_dir, mcfg.eos_token_id)


@pytest.fixture(scope="session")
def merged_lora(tiny_model_dir):
    """merged_lora(adapter_dir): the tiny model with that LoRA adapter added into its weights
    (W + scaling * B A, the plain formula): what a request served on the adapter must match."""
    import torch

    from raycluster.model.loader import load_model
    from raycluster.model.lora import TARGETS, load_adapter

    def merge(adapter_dir):
        model, cfg = load_model(tiny_model_dir)
        for (layer, module), (a, b) in load_adapter(adapter_dir, cfg, "ref").weights.items():
            with torch.no_grad():
                getattr(getattr(model.model.layers[layer], TARGETS[module]), module).weight += b @ a
        return model
    return merge
