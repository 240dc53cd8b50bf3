"""`meshspeed.planner.plan`: price every candidate layout, keep those that fit, rank them
by step time, and explain the winner axis by axis. The costs are cost.py's; the space is
candidates.py's; docs/planner.md walks through an example."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshspeed.planner.candidates import enumerate_candidates, why_not
from meshspeed.planner.cost import PRECISION, Candidate, memory, step_time
from meshspeed.planner.hardware import Hardware, Link, parse_bytes, parse_links
from meshspeed.planner.model_spec import PlanModel
from meshspeed.planner.plot import plot_plan

GB = 1e9


@dataclass
class Choice:
    """One priced candidate: its layout, bytes per rank by part, seconds per step by part."""

    candidate: Candidate
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool
    plan: Plan = field(repr=False)

    @property
    def step_time(self) -> float:
        return self.time["total"]

    def explain(self) -> str:
        """One sentence per axis (and per choice: ZeRO stage, offload, checkpointing,
        micro-batch) saying why this value, against the nearest alternative."""
        return "\n".join(self.plan._explain(self))

    def to_config(self, lr: float = 3e-4) -> dict[str, Any]:
        """The layout as a DeepSpeed-format config that meshspeed.config.load_config
        accepts (with dp_world_size = dp). Activation checkpointing also needs the model
        to checkpoint its blocks (meshspeed.checkpointing.checkpoint), as in DeepSpeed;
        expert parallelism is the MoE layers' ep_size (GPTConfig.moe_ep_size)."""
        c, precision = self.candidate, self.plan.precision
        cfg: dict[str, Any] = {
            "train_batch_size": self.plan.global_batch,
            "train_micro_batch_size_per_gpu": c.micro_batch,
            "gradient_accumulation_steps": c.grad_accum,
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": c.stage},
        }
        if precision in ("bf16", "fp16"):
            cfg[precision] = {"enabled": True}
        if c.offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": c.offload}
        if c.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": c.tp, "sequence_parallel": c.splits_sequence_over_tp}
        if c.pp > 1:
            cfg["pipeline"] = {"stages": c.pp}
        if c.cp > 1:
            cfg["sequence_parallel_size"] = c.cp
        if c.checkpointing:
            cfg["activation_checkpointing"] = {"partition_activations": c.tp > 1}
        return cfg

    def summary(self) -> str:
        m, t = self.memory, self.time
        comm = sum(t[k] for k in ("tp", "cp", "ep", "pp", "dp"))
        return (f"{self.candidate.label():45s} {t['total'] * 1e3:10.1f} ms  "
                f"(compute {t['compute'] * 1e3:.1f}, comm {comm * 1e3:.1f}, bubble {t['bubble'] * 1e3:.1f})"
                f"  {m['total'] / GB:7.2f} GB/rank")


@dataclass
class Plan:
    """The ranked result. `candidates`: the layouts that fit, fastest first; `best`:
    the first; `rejected`: how many were priced and did not fit in memory."""

    model: PlanModel
    hardware: Hardware
    global_batch: int
    seq_len: int
    precision: str
    headroom: float
    candidates: list[Choice] = field(default_factory=list)
    rejected: int = 0

    @property
    def best(self) -> Choice:
        if not self.candidates:
            raise ValueError(self._nothing_fits())
        return self.candidates[0]

    def price(self, c: Candidate) -> Choice:
        """Cost one layout of this plan's job (its degrees must multiply to the devices,
        dp x micro-batch x accumulation to the global batch)."""
        if c.world != self.hardware.gpus:
            raise ValueError(f"{c.label()} uses {c.world} devices, not the {self.hardware.gpus} "
                             "of this plan")
        if c.dp * c.micro_batch * c.grad_accum != self.global_batch:
            raise ValueError(f"{c.label()} takes {c.dp * c.micro_batch * c.grad_accum} samples, not "
                             f"the global batch {self.global_batch} (dp x micro-batch x accumulation)")
        mem = memory(self.model, c, self.seq_len, self.precision, self.headroom)
        t = step_time(self.model, c, self.hardware, self.global_batch, self.seq_len, self.precision)
        return Choice(c, mem, t, mem["total"] <= self.hardware.gpu_memory, self)

    def table(self, top: int = 10) -> str:
        head = (f"{len(self.candidates)} layouts fit ({self.rejected} priced layouts do not fit "
                f"{self.hardware.gpu_memory / GB:.1f} GB); fastest {min(top, len(self.candidates))}:")
        return "\n".join([head] + [f"{i + 1:3d}. {ch.summary()}" for i, ch in enumerate(self.candidates[:top])])

    def write_config(self, path: str | Path, choice: Choice | None = None) -> dict[str, Any]:
        cfg = (choice or self.best).to_config()
        Path(path).write_text(json.dumps(cfg, indent=2) + "\n")
        return cfg

    def plot(self, path: str | Path, top: int = 8) -> None:
        plot_plan(self, path, top)

    # -- explanation ------------------------------------------------------------------------
    def _nothing_fits(self) -> str:
        return (f"no layout of {self.model.num_params / 1e9:.2f}B parameters on {self.hardware.gpus} "
                f"devices of {self.hardware.gpu_memory / GB:.1f} GB fits ({self.rejected} priced); "
                "add devices, shorten seq_len, or allow offload / checkpointing")

    def _variant(self, c: Candidate, **change) -> Choice | str:
        """The candidate with `change` applied (dp absorbing a degree change; the
        micro-batch kept when it still divides), priced; or why it cannot run."""
        new = dataclasses.replace(c, **change)
        if "micro_batch" not in change:
            new = dataclasses.replace(new, dp=self.hardware.gpus // (new.tp * new.pp * new.cp))
        if new.dp < 1 or new.world != self.hardware.gpus:
            return "the degrees would not multiply to the device count"
        per_dp = self.global_batch // new.dp if self.global_batch % new.dp == 0 else 0
        if not per_dp:
            return f"dp {new.dp} does not divide the global batch {self.global_batch}"
        mb = new.micro_batch if per_dp % new.micro_batch == 0 else 1
        new = dataclasses.replace(new, micro_batch=mb, grad_accum=per_dp // mb)
        reason = why_not(self.model, new, self.global_batch, self.seq_len, 1 << 30)
        return reason if reason is not None else self.price(new)

    def _versus(self, choice: Choice, what: str, alt: Choice | str) -> str:
        if isinstance(alt, str):
            return f"{what} is not possible: {alt}"
        if not alt.fits:
            return (f"{what} would need {alt.memory['total'] / GB:.1f} GB per rank, over the "
                    f"{self.hardware.gpu_memory / GB:.1f} GB device")
        dt = (alt.step_time - choice.step_time) * 1e3
        return f"{what} would take {abs(dt):.1f} ms per step {'more' if dt >= 0 else 'less'}"

    def _explain(self, ch: Choice) -> list[str]:
        c, hw, out = ch.candidate, self.hardware, []
        for axis in ("tp", "cp", "pp", "ep"):
            deg = getattr(c, axis)
            if axis == "ep" and not self.model.num_experts:
                continue
            alts = []
            if deg > 1:
                alts.append(self._versus(ch, f"{axis} {deg // 2}", self._variant(c, **{axis: deg // 2})))
            if c.dp % 2 == 0:
                double = self._variant(c, **{axis: deg * 2})
                note = ""
                if axis == "tp" and not isinstance(double, str) and hw.crosses_nodes(1, deg * 2):
                    note = " (its all-reduces would cross nodes)"
                alts.append(self._versus(ch, f"{axis} {deg * 2}{note}", double))
            if c.dp % 2:
                alts.append(f"{axis} {deg * 2} would need devices that data parallelism (dp {c.dp}) "
                            "does not have to give")
            why = "; ".join(alts)
            out.append(f"{axis} {deg}: {why}.")
        groups = c.strides()
        stride, n = groups["dp_cp"]
        where = "across nodes" if hw.crosses_nodes(stride, n) else "inside a node"
        split = c.tp * c.cp * c.pp
        if c.dp == 1:
            out.append(f"dp 1: the model split (tp x cp x pp = {split}) takes every device; the "
                       f"{self.global_batch} samples run as {c.grad_accum} micro-batches of {c.micro_batch}.")
        else:
            out.append(f"dp {c.dp}: the {hw.gpus} devices over the model split of {split}; each "
                       f"data-parallel rank takes {self.global_batch // c.dp} samples a step, and the "
                       f"gradient traffic runs {where}, {ch.time['dp'] * 1e3:.1f} ms of it exposed per step.")
        stage_alts = [self._versus(ch, f"ZeRO {s}", self._variant(c, stage=s))
                      for s in (0, 1, 2, 3) if s != c.stage and not (s == 0 and c.offload)]
        out.append(f"ZeRO stage {c.stage}: " + "; ".join(stage_alts) + ".")
        out.append(f"offload {c.offload or 'none'}: " + self._versus(
            ch, "offload cpu" if not c.offload else "no offload",
            self._variant(c, offload=None if c.offload else "cpu") if c.stage or c.offload
            else "offload needs ZeRO stage >= 1") + ".")
        out.append(f"activation checkpointing {'on' if c.checkpointing else 'off'}: " + self._versus(
            ch, "turning it " + ("off" if c.checkpointing else "on"),
            self._variant(c, checkpointing=not c.checkpointing)) + ".")
        mb_alts = [self._versus(ch, f"micro-batch {mb}", self._variant(c, micro_batch=mb))
                   for mb in (c.micro_batch // 2, c.micro_batch * 2)
                   if mb >= 1 and (self.global_batch // c.dp) % mb == 0 and mb != c.micro_batch]
        out.append(f"micro-batch {c.micro_batch} x {c.grad_accum} accumulation steps: "
                   + ("; ".join(mb_alts) or "the only split of the batch") + ".")
        return out


def plan(model: Any, gpus: int, gpu_memory: float | str, link: str | dict | None = None, *,
         global_batch: int, seq_len: int, gpus_per_node: int = 8,
         peak_flops: float = 400e12, precision: str = "bf16", headroom: float = 0.1,
         mfu: float = 0.5, latency: dict[str, float] | None = None, overlap: float = 0.8,
         layer_overhead: float = 0.0, cpu_adam: float = 1e9, stages=(0, 1, 2, 3),
         offloads=(None, "cpu"), checkpointing=(False, True)) -> Plan:
    """Rank every layout of `model` on `gpus` devices by predicted step time.

    model: a GPTConfig, a dict of its fields, or a JSON path (meshspeed's names or a
    Hugging Face config.json). gpu_memory: bytes or "80GB". link: "intra=900GB/s,
    inter=50GB/s" or a dict ("pcie" also accepted). latency: alpha seconds per ring step,
    {"intra": 5e-6, "inter": 2e-5} by default. peak_flops: per device; mfu: the fraction
    of it compute reaches. headroom: fraction of the device kept free for fragmentation.
    overlap: fraction of data-parallel traffic hidden under compute. layer_overhead:
    seconds per layer per micro-batch beyond FLOPs (0 on GPUs; calibrated on CPUs).
    Returns a Plan; its `best` raises ValueError naming the problem if nothing fits.
    """
    if precision not in PRECISION:
        raise ValueError(f"precision must be one of {', '.join(PRECISION)}, got {precision!r}")
    if not isinstance(global_batch, int) or not isinstance(seq_len, int) or global_batch < 1 or seq_len < 1:
        raise ValueError(f"global_batch and seq_len must be positive integers, got {global_batch!r}, {seq_len!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction of device memory in [0, 1), got {headroom}")
    spec = PlanModel.from_any(model)
    links = parse_links(link if link is not None else {"intra": "900GB/s", "inter": "50GB/s"})
    lat = {"intra": 5e-6, "inter": 2e-5, **(latency or {})}
    hw = Hardware(gpus=gpus, gpu_memory=parse_bytes(gpu_memory, "gpu_memory"), gpus_per_node=gpus_per_node,
                  peak_flops=float(peak_flops), mfu=mfu,
                  intra=Link(links.get("intra", 900e9), lat["intra"]),
                  inter=Link(links.get("inter", 50e9), lat["inter"]),
                  pcie=links.get("pcie", 25e9), cpu_adam=cpu_adam,
                  layer_overhead=layer_overhead, overlap=overlap)
    result = Plan(spec, hw, global_batch, seq_len, precision, headroom)
    usable = hw.gpu_memory
    for c in enumerate_candidates(spec, gpus, global_batch, seq_len, gpus_per_node, stages,
                                  offloads, checkpointing):
        choice = result.price(c)
        if choice.memory["total"] <= usable:
            result.candidates.append(choice)
        else:
            result.rejected += 1
    result.candidates.sort(key=lambda ch: (ch.step_time, ch.time["dp_hidden"], ch.memory["total"]))
    return result
