"""The planner's cost model and `meshspeed plan`, checked by arithmetic and against what
torch counts: parameter counts of real models, FLOPs, collective times, the pipeline
bubble, the candidate space, the explanation, and the written config loading."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from meshspeed.cli import main as cli_main
from meshspeed.config import load_config
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.planner import model_spec, plan
from meshspeed.planner.candidates import enumerate_candidates, why_not
from meshspeed.planner.cost import Candidate, memory, rank_params, step_time
from meshspeed.planner.estimate import estimate_memory
from meshspeed.planner.hardware import Hardware, Link, parse_bytes, parse_links
from meshspeed.planner.model_spec import PlanModel

TINY = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 128}
MOE = {"vocab_size": 512, "max_seq_len": 128, "n_layer": 3, "n_head": 4, "n_kv_head": 2,
       "d_model": 128, "moe_num_experts": 4, "moe_top_k": 2, "moe_capacity_factor": 4.0}
LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000}
FAST = {"intra": "1e15", "inter": "1e15"}  # links so fast that communication costs ~0


def test_sizes_and_links_are_read_and_bad_ones_named():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("900GB/s") == 900e9 and parse_bytes(1.5e9) == 1.5e9
    assert parse_links("intra=900GB/s, inter=50GB/s") == {"intra": 900e9, "inter": 50e9}
    with pytest.raises(ValueError, match="80 gigs"):
        parse_bytes("80 gigs", "gpu_memory")
    with pytest.raises(ValueError, match="NAME=SPEED"):
        parse_links("900GB/s")
    with pytest.raises(ValueError, match="unknown link nvlink"):
        parse_links("nvlink=900GB/s")


def test_ring_collective_times_are_alpha_beta():
    link = Link(bandwidth=100.0, alpha=0.5)
    # all-reduce over 4: 2 x log2(4) steps of alpha (tree latency), 2 x 3/4 of 400 bytes
    # at 100 B/s (ring bandwidth); over 3 ranks the ring's 2 steps are already the fewest
    assert link.ring(4, 400, 2) == pytest.approx(2 * 2 * 0.5 + 2 * 0.75 * 4)
    assert link.ring(3, 300, 1) == pytest.approx(2 * 0.5 + 2 / 3 * 3)
    assert link.ring(16, 0.0) == 0
    assert link.ring(1, 400) == 0 and link.p2p(100) == pytest.approx(1.5)
    hw = Hardware(gpus=16, gpu_memory=1e9, gpus_per_node=8)
    assert hw.link(1, 8) is hw.intra and hw.link(1, 16) is hw.inter
    assert hw.link(8, 2) is hw.inter and not hw.crosses_nodes(2, 4)


@pytest.mark.parametrize("fields", [TINY, MOE])
def test_parameter_counts_are_the_models(fields):
    cfg = GPTConfig(**fields)
    spec = PlanModel.from_any(cfg)
    assert spec.num_params == sum(p.numel() for p in GPT(cfg).parameters())
    dense, expert = rank_params(spec, Candidate(dp=1))
    assert dense + expert == spec.num_params


def test_hugging_face_config_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    path = tmp_path / "config.json"
    path.write_text(hf.to_json_string())
    model = transformers.LlamaForCausalLM(hf)
    assert PlanModel.from_any(str(path)).num_params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="is not a file"):
        PlanModel.from_any(str(tmp_path / "missing.json"))


def test_a_config_json_with_a_typo_names_the_key_and_the_one_meant(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**{k: v for k, v in TINY.items() if k != "n_layer"}, "n_layers": 2}))
    with pytest.raises(ValueError, match=re.escape(f"unknown key 'n_layers' in {path}; did you mean 'n_layer'? "
                                                   "known keys: vocab_size, max_seq_len, n_layer,")):
        PlanModel.from_any(str(path))
    # a Hugging Face config has many keys the planner does not read: a size it lacks is named
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layer": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "vocab_size": 320, "rope_scaling": None}))
    with pytest.raises(ValueError, match=re.escape("has no 'num_hidden_layers' (meshspeed's n_layer); "
                                                   "did you mean 'num_hidden_layer'?")):
        PlanModel.from_any(str(path))
    assert set(model_spec.KNOWN_KEYS) == {f.name for f in dataclasses.fields(GPTConfig)}


@pytest.mark.parametrize("fields", [TINY, MOE])
def test_flops_are_what_torch_counts_plus_attention(fields):
    """FlopCounterMode counts every matmul of forward and backward, but not the CPU fused
    attention kernel; so the formula minus its attention term (12 L d S per token) must
    match it. Tolerance 1%: the router's softmax/top-k and the loss are not matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = GPTConfig(**fields)
    torch.manual_seed(0)
    model = GPT(cfg)
    seq, batch = 64, 2
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    spec = PlanModel.from_any(cfg)
    attention = 12 * cfg.n_layer * cfg.d_model * seq
    predicted = (spec.train_flops_per_token(seq) - attention) * batch * seq
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.01)


def test_model_states_per_rank_are_zero_formulas():
    spec = PlanModel.from_any(TINY)
    psi = spec.num_params
    for stage, per_param in ((0, 16 * psi), (1, 4 * psi + 12 * psi / 4), (2, 2 * psi + 14 * psi / 4),
                             (3, 16 * psi / 4)):
        mem = memory(spec, Candidate(dp=4, stage=stage), 64, "bf16")
        assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(per_param, abs=64)
    # tp halves the split weights, not the norms; pp halves the layers
    dense, _ = rank_params(spec, Candidate(dp=1, tp=2))
    norms = (2 * TINY["n_layer"] + 1) * TINY["d_model"]
    assert dense == (psi - norms) // 2 + norms
    cfg = GPTConfig(**TINY)
    emb = cfg.vocab_size * cfg.d_model
    block = sum(p.numel() for p in GPT(cfg).layers[0].parameters())
    assert rank_params(spec, Candidate(dp=1, pp=2))[0] == block + emb + cfg.d_model  # the last stage
    # offload takes the optimizer (and at stage 2 the gradient shard) off the device
    off = memory(spec, Candidate(dp=4, stage=2, offload="cpu"), 64)
    assert off["optimizer"] == 0 and off["grads"] == 0
    est = estimate_memory(psi, 4, 2)
    assert off["params"] == est["params"]


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    spec = PlanModel.from_any({**TINY, "n_layer": 4})
    hw = Hardware(gpus=4, gpu_memory=1e12, peak_flops=1e12, intra=Link(1e18, 0), inter=Link(1e18, 0))
    for m in (1, 4, 16):
        t = step_time(spec, Candidate(dp=1, pp=4, micro_batch=1, grad_accum=m), hw, m, 64)
        assert t["bubble"] / (t["compute"] + t["bubble"]) == pytest.approx(3 / (m + 3))


def test_tensor_parallel_traffic_is_megatron_count():
    """Forward and backward: 4 all-reduces per block + 2 for the embedding, each of the
    micro-batch's activations; recomputation adds 2 per block."""
    spec = PlanModel.from_any(TINY)
    hw = Hardware(gpus=2, gpu_memory=1e12, intra=Link(1e9, 1e-5))
    act = 4 * 64 * TINY["d_model"] * 2  # mb 4 x seq 64 x d, bf16
    for ckpt, per_block in ((False, 4), (True, 6)):
        c = Candidate(dp=1, tp=2, micro_batch=4, grad_accum=2, checkpointing=ckpt)
        t = step_time(spec, c, hw, 8, 64)
        calls = 2 * (TINY["n_layer"] * per_block + 2)
        assert t["tp"] == pytest.approx(calls * hw.intra.ring(2, act, 2))


def test_candidate_space_and_refusals():
    spec = PlanModel.from_any({**TINY, "n_head": 6, "d_model": 96, "n_layer": 3})
    cands = list(enumerate_candidates(spec, 8, 16, 64, stages=(0,), offloads=(None,),
                                      checkpointing=(False,)))
    assert cands and all(c.world == 8 and 16 % (c.dp * c.micro_batch) == 0 for c in cands)
    assert {c.tp for c in cands} == {1, 2} and {c.pp for c in cands} == {1}
    assert "heads" in why_not(spec, Candidate(dp=2, tp=4), 16, 64, 8)
    assert "layers" in why_not(spec, Candidate(dp=4, pp=2), 16, 64, 8)
    assert "span nodes" in why_not(spec, Candidate(dp=1, tp=16), 16, 64, 8)
    assert "stage >= 1" in why_not(spec, Candidate(dp=8, offload="cpu"), 16, 64, 8)


def test_seventy_b_on_eight_nodes():
    p = plan(LLAMA_70B, 64, "80GB", {"intra": "900GB/s", "inter": "50GB/s"},
             global_batch=512, seq_len=4096)
    best = p.best
    assert best.fits and best.memory["total"] <= 80e9
    assert [ch.step_time for ch in p.candidates] == sorted(ch.step_time for ch in p.candidates)
    # the states alone (16 bytes x 69B) cannot sit replicated: the winner shards them
    c = best.candidate
    assert c.tp * c.pp > 1 or c.stage == 3
    assert c.tp <= 8  # never tp across nodes
    lines = best.explain().splitlines()
    heads = [line.split(":")[0].split()[0] for line in lines]
    assert heads == ["tp", "cp", "pp", "dp", "ZeRO", "offload", "activation", "micro-batch"]
    assert all(line.endswith(".") for line in lines)


def test_a_small_model_is_plain_data_parallel():
    """0.5M parameters on 8 devices: any model split only adds communication."""
    p = plan(TINY, 8, "80GB", global_batch=64, seq_len=64)
    c = p.best.candidate
    assert (c.dp, c.tp, c.pp, c.cp) == (8, 1, 1, 1) and not c.checkpointing


def test_nothing_fits_is_one_clear_sentence():
    p = plan(LLAMA_70B, 8, "16GB", global_batch=8, seq_len=4096, offloads=(None,))
    with pytest.raises(ValueError, match="no layout of 68.98B parameters on 8 devices of 16.0 GB fits"):
        _ = p.best


@pytest.mark.parametrize("layout", [Candidate(dp=4, stage=2, micro_batch=2, grad_accum=1),
                                    Candidate(dp=1, tp=2, pp=2, cp=2, stage=1, offload="cpu",
                                              checkpointing=True, micro_batch=1, grad_accum=8)])
def test_written_config_loads(tmp_path, layout):
    p = plan({**TINY, "n_layer": 4}, layout.world, "80GB", global_batch=8, seq_len=64)
    choice = p.price(layout)
    path = tmp_path / "ds.json"
    p.write_config(path, choice)
    cfg = load_config(str(path), dp_world_size=layout.dp)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (8, layout.micro_batch, layout.grad_accum)
    assert cfg.zero_optimization.stage == layout.stage and cfg.bf16.enabled
    assert cfg.tensor_parallel.size == layout.tp and cfg.sequence.size == layout.cp
    assert (cfg.zero_optimization.offload_optimizer is not None) == bool(layout.offload)
    if layout.pp > 1:
        assert cfg.pipeline.stages == layout.pp


def test_price_refuses_a_layout_of_another_job():
    p = plan(TINY, 4, "80GB", global_batch=8, seq_len=64)
    with pytest.raises(ValueError, match="16 samples, not the global batch 8"):
        p.price(Candidate(dp=4, micro_batch=2, grad_accum=2))
    with pytest.raises(ValueError, match="2 devices, not the 4"):
        p.price(Candidate(dp=2, micro_batch=4))


def test_cli_writes_config_and_plot(tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(LLAMA_70B))
    out, png = tmp_path / "ds.json", tmp_path / "plan.png"
    rc = cli_main(["plan", "--model", str(model), "--gpus", "64", "--gpu-memory", "80GB",
                   "--link", "intra=900GB/s,inter=50GB/s", "--global-batch", "512",
                   "--seq-len", "4096", "--top", "5", "--write-config", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0 and "best:" in text and "tp " in text
    assert load_config(str(out), dp_world_size=json.loads(out.read_text())["train_batch_size"]
                       // json.loads(out.read_text())["train_micro_batch_size_per_gpu"]
                       // json.loads(out.read_text())["gradient_accumulation_steps"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = cli_main(["plan", "--model", str(model), "--gpus", "8", "--gpu-memory", "eighty",
                   "--global-batch", "8", "--seq-len", "128"])
    assert rc == 2 and "gpu_memory: cannot read 'eighty'" in capsys.readouterr().err


def test_moe_expert_parallel_shards_experts():
    spec = PlanModel.from_any(MOE)
    one = rank_params(spec, Candidate(dp=4, ep=1))[1]
    four = rank_params(spec, Candidate(dp=4, ep=4))[1]
    assert one == spec.expert_params_per_layer() and four == one // 4
    t = step_time(spec, Candidate(dp=4, ep=4, micro_batch=1, grad_accum=1),
                  Hardware(gpus=4, gpu_memory=1e12), 4, 64)
    assert t["ep"] > 0 and math.isfinite(t["total"])


def test_groups_that_span_nodes_run_at_the_inter_node_link():
    spec = PlanModel.from_any(TINY)
    c = Candidate(dp=4, stage=0, micro_batch=1, grad_accum=1)
    inside = Hardware(gpus=4, gpu_memory=1e12, gpus_per_node=4, intra=Link(100e9, 0), inter=Link(10e9, 0),
                      overlap=0.0)
    across = dataclasses.replace(inside, gpus_per_node=2)
    t_in, t_out = (step_time(spec, c, hw, 4, 64)["dp"] for hw in (inside, across))
    assert t_out == pytest.approx(10 * t_in)  # bandwidth-only links: the 10x slower one
    grads = 2 * spec.num_params  # bf16
    assert t_in == pytest.approx(2 * 3 / 4 * grads / 100e9)


def test_ulysses_traffic_is_four_all_to_alls_each_way():
    """cp: q, k, v and the output change layout, forward and backward, per block; with
    n_kv_head = n_head each of the 4 tensors is the local activation."""
    spec = PlanModel.from_any(TINY)
    hw = Hardware(gpus=2, gpu_memory=1e12, intra=Link(1e9, 1e-5))
    t = step_time(spec, Candidate(dp=1, cp=2, micro_batch=2, grad_accum=1), hw, 2, 64)
    act = 2 * 32 * TINY["d_model"] * 2  # mb 2 x S/cp 32 x d, bf16
    assert t["cp"] == pytest.approx(TINY["n_layer"] * 2 * 4 * hw.intra.ring(2, act))


def test_plot_legends_are_below_the_bars():
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from meshspeed.planner.plot import figure

    fig = figure(plan(TINY, 4, "80GB", global_batch=8, seq_len=64), top=4)
    renderer = FigureCanvasAgg(fig).get_renderer()
    for ax in fig.axes:  # the legend's top edge is under the axes' bottom edge (and tick labels)
        legend, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.y1 <= frame.y0, (legend, frame)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    p = plan(TINY, 2, "80GB", global_batch=4, seq_len=64)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="needs matplotlib, which is not installed"):
        p.plot(tmp_path / "x.png")


def test_cli_json(tmp_path, capsys):
    model = tmp_path / "gpt.json"
    model.write_text(json.dumps(TINY))
    assert cli_main(["plan", "--model", str(model), "--gpus", "4", "--gpu-memory", "8GB",
                     "--global-batch", "8", "--seq-len", "64", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["candidates"]) == 3 and out["best"] == out["candidates"][0]
    assert out["best"]["config"]["train_batch_size"] == 8
