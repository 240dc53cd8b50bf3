"""`init_inference(checkpoint=...)`: a safetensors file, a sharded Hugging Face directory
(model.safetensors.index.json) and a meshspeed training checkpoint, loaded into a model
with other weights, give the saved model's logits (exact at tp=1; within 1e-5 at tp=2).
Bytes read per rank are asserted against the formula of Note [reading only this rank's
shard]: the split pieces this rank holds plus the replicated parameters -- about half the
model at tp=2, never all of it."""

from __future__ import annotations

import copy

import torch

import meshspeed
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.inference.engine import init_inference
from meshspeed.testing import run_distributed
from meshspeed.topology.shards import shards_by_param
from tests.inference.test_init_inference import VOCAB, build, device, logits, prompt


def expected_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank should read, bytes of the whole model) for an fp32 checkpoint."""
    shards = shards_by_param(model)
    mine = whole = 0
    for p in model.parameters():
        shard = shards.get(id(p))
        numel = p.numel() if shard is None else shard.held * p.numel() // shard.local_size
        mine += numel * 4
        whole += (p.numel() if shard is None else
                  torch.Size(shard.logical_shape).numel()) * 4
    return mine, whole


def _save_safetensors(model, path: str) -> None:
    from safetensors.torch import save_model

    save_model(model, path)


def test_safetensors_file_tp1(tmp_path):
    saved = build("gpt2", seed=0)
    _save_safetensors(saved, str(tmp_path / "model.safetensors"))
    ids = prompt()
    engine = init_inference(build("gpt2", seed=5), checkpoint="model.safetensors", base_dir=str(tmp_path))
    assert torch.equal(logits(engine, ids), logits(saved.to(device()), ids))
    mine, whole = expected_bytes(engine.module)
    assert engine.load_stats.bytes_read == mine == whole


def test_base_model_checkpoint_into_model_with_head(tmp_path):
    """The hub's `gpt2` holds GPT2Model's names (no `transformer.` prefix); the head is tied."""
    saved = build("gpt2", seed=0)
    _save_safetensors(saved.transformer, str(tmp_path / "base.safetensors"))
    engine = init_inference(build("gpt2", seed=5), checkpoint=str(tmp_path / "base.safetensors"))
    ids = prompt()
    assert torch.equal(logits(engine, ids), logits(saved.to(device()), ids))


def test_checkpoint_into_fp16_model(tmp_path):
    saved = build("gpt2", seed=0)
    _save_safetensors(saved, str(tmp_path / "model.safetensors"))
    engine = init_inference(build("gpt2", seed=5), dtype=torch.float16,
                            checkpoint=str(tmp_path / "model.safetensors"))
    assert {p.dtype for p in engine.module.parameters()} == {torch.float16}
    ids = prompt()  # the same rounding of the same weights, the same ops: exact
    assert torch.equal(logits(engine, ids), logits(saved.half().to(device()), ids))


def test_hf_sharded_directory_tp1(tmp_path):
    saved = build("llama", seed=0)
    saved.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = init_inference(build("llama", seed=5), checkpoint=str(tmp_path))
    ids = prompt()
    assert torch.equal(logits(engine, ids), logits(saved.to(device()), ids))


def _tp2_from_files(family: str, root: str):
    ids = prompt()
    saved = build(family, seed=0)
    ref = logits(saved, ids)
    if torch.distributed.get_rank() == 0:
        if family == "llama":
            saved.save_pretrained(root, max_shard_size="60KB")
        else:
            _save_safetensors(saved, f"{root}/model.safetensors")
    torch.distributed.barrier()
    path = root if family == "llama" else f"{root}/model.safetensors"
    engine = init_inference(build(family, seed=5), tensor_parallel={"tp_size": 2}, checkpoint=path)
    mine, whole = expected_bytes(engine.module)
    return {"diff": (logits(engine, ids) - ref).abs().max().item(), "read": engine.load_stats.bytes_read,
            "mine": mine, "whole": whole}


def _check_half(results) -> None:
    for r in results:
        assert r["diff"] < 1e-5, r["diff"]
        assert r["read"] == r["mine"], (r["read"], r["mine"])
        assert r["read"] < 0.6 * r["whole"], (r["read"], r["whole"])  # ~1/2 + replicated norms/wpe


def test_safetensors_gpt2_tp2(tmp_path):
    _check_half(run_distributed(_tp2_from_files, world_size=2, args=("gpt2", str(tmp_path))))


def test_hf_directory_llama_tp2(tmp_path):
    _check_half(run_distributed(_tp2_from_files, world_size=2, args=("llama", str(tmp_path))))


def _meta_model_tp2(root: str):
    """A GPT-2 built on the meta device (no memory), split, then only this rank's shards
    allocated and read: resident parameter bytes are the shard's, never the whole model's."""
    ids = prompt()
    saved = build("gpt2", seed=0)
    ref = logits(saved, ids)
    if torch.distributed.get_rank() == 0:
        _save_safetensors(saved, f"{root}/model.safetensors")
    torch.distributed.barrier()
    with torch.device("meta"):
        model = build("gpt2", seed=5)
    engine = init_inference(model, tensor_parallel={"tp_size": 2}, checkpoint=f"{root}/model.safetensors")
    mine, whole = expected_bytes(engine.module)
    resident = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    padding = resident - mine  # the vocabulary's padding rows, if any
    return {"diff": (logits(engine, ids) - ref).abs().max().item(), "read": engine.load_stats.bytes_read,
            "mine": mine, "whole": whole, "resident": resident, "padding": padding,
            "meta": any(p.is_meta for p in engine.module.parameters())}


def test_meta_model_allocates_only_its_shards(tmp_path):
    results = run_distributed(_meta_model_tp2, world_size=2, args=(str(tmp_path),))
    _check_half(results)
    for r in results:
        assert not r["meta"]
        assert r["padding"] == 0 and r["resident"] == r["mine"] < 0.6 * r["whole"]


def _meshspeed_checkpoint(root: str, load_tp: int):
    """Save from a training engine (2 data-parallel ranks, ZeRO stage 1: each rank's file
    holds half of every master), then load at tp=load_tp into a model with other weights."""
    trained = build("gpt", seed=0)
    ref_model = copy.deepcopy(trained)
    engine, *_ = meshspeed.initialize(model=trained, model_parameters=trained.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.save_checkpoint(root, tag="t0")
    ids = prompt()
    ref = logits(ref_model, ids)
    inf = init_inference(build("gpt", seed=5), tensor_parallel={"tp_size": load_tp},
                         checkpoint=f"{root}")
    mine, whole = expected_bytes(inf.module)
    try:  # the same checkpoint into a wider model: logical shapes compared, whatever the tp
        init_inference(build("gpt", d_model=128), tensor_parallel={"tp_size": load_tp}, checkpoint=root)
        wrong = "no error"
    except CheckpointError as err:
        wrong = str(err)
    return {"diff": (logits(inf, ids) - ref).abs().max().item(), "read": inf.load_stats.bytes_read,
            "mine": mine, "whole": whole, "shape": tuple(logits(inf, ids).shape), "wrong": wrong}


def test_meshspeed_checkpoint_tp2(tmp_path):
    results = run_distributed(_meshspeed_checkpoint, world_size=2, args=(str(tmp_path), 2))
    _check_half(results)
    for r in results:
        assert r["shape"] == (2, 8, VOCAB)
        assert r["wrong"].endswith("is for another model: parameter 'tok_emb.weight' has shape "
                                   "(128, 64) in the checkpoint but (128, 128) in the model"), r["wrong"]


def test_meshspeed_checkpoint_tp1_reads_whole_model(tmp_path):
    for r in run_distributed(_meshspeed_checkpoint, world_size=2, args=(str(tmp_path), 1)):
        assert r["diff"] == 0.0
        assert r["read"] == r["mine"] == r["whole"]
