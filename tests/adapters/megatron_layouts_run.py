"""The Megatron-Core layouts of test_megatron_layouts.py, trained on each rank, with their references."""

from __future__ import annotations

import json
import logging
import os

import torch

from tests.helpers import ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 2
DROP_AUX = {"moe_expert_capacity_factor": 1.0, "moe_aux_loss_coeff": 0.01}
OPTIMIZER_FAMILIES = {
    "grad_reduced": "grad",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "param_updated": "param",
}


def _layouts(world: int) -> list[tuple[str, dict]]:
    """(tag, Layout keys). The first of each model kind (dense, MoE) is the reference without model
    parallelism."""
    if world == 2:
        return [
            ("dp2", {}),
            ("tp2", {"tp": 2}),
            ("tp2-sp-distopt", {"tp": 2, "sp": True, "dist_opt": True}),
            ("pp2", {"pp": 2}),
            ("pp2-vpp2-distopt-overlap", {"pp": 2, "vpp": 2, "dist_opt": True, "overlap": True}),
            # msprobe's documented insertion: chunk 0 only, the pipeline group, no dp/tp groups given
            ("pp2-vpp2-msprobe", {"pp": 2, "vpp": 2, "msprobe": True}),
            ("moe-dp2", {"experts": 4}),
            ("moe-ep2", {"experts": 4, "ep": 2}),
            ("moe-ep2-distopt", {"experts": 4, "ep": 2, "dist_opt": True}),
            # token dropping (capacity factor 1) and a load-balancing loss: moe_load's dropped, aux_loss
            ("moe-ep2-drop-aux", {"experts": 4, "ep": 2, "extra": DROP_AUX}),
            # all local experts in one GroupedMLP weight, the same name on both expert-parallel ranks
            # (GroupedMLP takes bf16 only)
            ("grouped-dp2-bf16", {"experts": 4, "grouped": True, "bf16": True}),
            # (Megatron's compiled activation is covered by the layout above: not compiled again here)
            (
                "grouped-ep2-distopt-bf16",
                {
                    "experts": 4,
                    "ep": 2,
                    "grouped": True,
                    "dist_opt": True,
                    "bf16": True,
                    "fused_activation": False,
                },
            ),
        ]
    return [
        ("dp4", {}),
        ("dp4-bf16", {"bf16": True}),
        ("tp2-dp2-distopt", {"tp": 2, "dist_opt": True}),
        ("pp2-dp2-bf16", {"pp": 2, "bf16": True}),
        ("tp2-pp2", {"tp": 2, "pp": 2}),
        ("tp2-pp2-sp-distopt-bf16", {"tp": 2, "pp": 2, "sp": True, "dist_opt": True, "bf16": True}),
        ("moe-dp4", {"experts": 4}),
        # expert data parallel 2 under the distributed optimizer: expert shards merged over it
        ("moe-ep2-dp2-distopt", {"experts": 4, "ep": 2, "dist_opt": True}),
        # expert tensor parallel 2 (Megatron's default: the tensor-parallel size) x EP 2
        # (Megatron refuses MoE with tensor parallelism but without sequence parallelism)
        ("moe-tp2-ep2-sp", {"experts": 4, "ep": 2, "tp": 2, "sp": True}),
    ]


def _run_layout(rank: int, out_root: str, tag: str, keys: dict) -> dict:
    from tests.megatron_gpt import Layout, full_optimizer_tensors, setup, train_step
    from trainermon import TrainerMon

    out = os.path.join(out_root, tag)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out_root, f"{tag}-rank{rank}.json")
    with open(cfg, "w") as fh:
        body = {
            "wg_distribution": True,
            "mv_distribution": True,
            "param_distribution": True,
            "update_distribution": True,
            "moe_distribution": True,
            "xy_distribution": True,
            "all_xy": True,
            "ops": list(OPS),
            "ndigits": 12,
        }
        json.dump(body, fh)
    keys = dict(keys)
    msprobe_style = keys.pop("msprobe", False)
    layout = Layout(clip=1e9, **keys)
    model, optimizer = setup(layout)
    warnings = _LogCapture()
    if msprobe_style:
        from megatron.core import parallel_state as mpu

        monitor = TrainerMon(
            cfg, process_group=mpu.get_pipeline_model_parallel_group(), params_have_main_grad=True
        )
        monitor.set_monitor(model[0], grad_acc_steps=2, optimizer=optimizer)
    else:
        monitor = TrainerMon(cfg, params_have_main_grad=True)
        monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    refs: dict[tuple, dict] = {}
    norms, derived = [], []
    routers = _RouterReference(model) if keys.get("experts") else None
    # the update's reference: full parameters before and after each step, gathered by the test
    before = {n: t["param"] for n, t in full_optimizer_tensors(model, optimizer, keys=("param",)).items()}
    for step in range(STEPS):
        if routers is not None:
            routers.start()
        _, grad_norm = train_step(model, optimizer, layout, step)
        norms.append(grad_norm)
        if routers is not None:
            refs.update({("moe_load", name, step): ref for name, ref in routers.finish().items()})
        for name, tensors in full_optimizer_tensors(model, optimizer).items():
            for family, key in OPTIMIZER_FAMILIES.items():
                refs[(family, name, step)] = {**ref_stats(tensors[key]), "shape": list(tensors[key].shape)}
            delta = tensors["param"].double() - before[name].double()
            ratio = float(delta.norm() / before[name].double().norm())
            refs[("update", name, step)] = {**ref_stats(delta), "shape": list(delta.shape), "ratio": ratio}
            before[name] = tensors["param"]
        monitor.flush()
        batch = monitor.last_batch
        derived.append(None if batch is None else batch.derived.global_grad_norm)
    monitor.close()
    return {
        "run_dir": monitor.run_dir,
        "refs": refs,
        "norms": norms,
        "derived": derived,
        "faults": dict(monitor.faults.counts),
        "warnings": warnings.close(),
    }


class _RouterReference:
    """Tokens per expert from each TopKRouter's own output (its routing map after token dropping), the
    dropped tokens (tokens x top-k - routed), and Megatron's own per-layer load-balancing loss tracker,
    summed by the test over every rank (pipeline parallelism is off in the MoE layouts)."""

    def __init__(self, model: list) -> None:
        from tests.megatron_gpt import single_process_name

        self.names: dict[int, str] = {}
        self.modules = []
        for vpp, chunk in enumerate(model):
            root = chunk.module.module if hasattr(chunk.module, "module") else chunk.module
            for name, module in root.named_modules():
                if type(module).__name__ == "TopKRouter":
                    full = single_process_name(root, vpp, f"{name}.weight")[: -len(".weight")]
                    self.modules.append((full, module))
                    module.register_forward_hook(lambda m, i, o, n=full: self._count(n, m, o[1]))
        self.load: dict[str, list] = {}

    def _count(self, name: str, module, routing_map) -> None:
        routed = routing_map.detach().sum(0).double()
        dropped = routing_map.shape[0] * module.topk - routed.sum()
        self.load.setdefault(name, []).append(torch.cat([routed, dropped.reshape(1)]))

    def start(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.load = {}
        clear_aux_losses_tracker()

    def finish(self) -> dict[str, dict]:
        import torch.distributed as dist
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        out = {}
        for name, module in self.modules:
            total = torch.stack(self.load[name]).sum(0)
            aux = torch.zeros(1, dtype=torch.float64)
            if tracker is not None:  # this rank's mean over its micro-batches, averaged over ranks
                aux[0] = float(tracker["values"][module.layer_number - 1]) / len(self.load[name])
            both = torch.cat([total, aux])
            dist.all_reduce(both)
            out[name] = {
                "load": [int(v) for v in both[:-2].tolist()],
                "dropped": float(both[-2]),
                "aux": float(both[-1]) / dist.get_world_size() if tracker is not None else None,
            }
        return out


class _LogCapture(logging.Handler):
    """The monitor's warnings during a run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("trainermon").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def close(self) -> list[str]:
        logging.getLogger("trainermon").removeHandler(self)
        return self.messages


def _matrix(rank: int, world: int, out_root: str) -> dict:
    return {tag: _run_layout(rank, out_root, tag, keys) for tag, keys in _layouts(world)}
