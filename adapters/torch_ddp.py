"""Plain PyTorch and torch DistributedDataParallel (checked on torch 2.13).

- The step: torch's step pre/post hooks on the optimizer instance (or a wrapper of its `step()`).
- Pre-reduce gradient under DDP: a post-accumulate-grad hook on each parameter, on the backward that
  DDP reduces (its forward ran with gradient sync on, i.e. outside `no_sync()`). autograd runs it inside
  the parameter's AccumulateGrad, before DDP's own hook on that node copies the gradient into its bucket
  (or, with `gradient_as_bucket_view=True` and no communication hook, divides it in place by the world
  size), so `.grad` is then the local gradient accumulated over the step's micro-batches. DDP's
  communication-hook slot is left to the user: it takes one hook per model, and `fp16_compress_hook`,
  `bf16_compress_hook` or PowerSGD registered before or after `set_monitor` work as without the monitor.
  `.grad` read after backward cannot serve: by then DDP has reduced it (or scaled the bucket view).
  These taps, and the set of parameters DDP reduces, are in `adapters/ddp_taps.py`.
- Each micro-batch's own gradient: a tensor hook on the leaf parameter, which autograd calls with the
  incoming gradient before it is accumulated into `.grad` (and before DDP sees it).
- Without DDP there is no reduction: the pre-reduce gradient is `.grad` at the optimizer step.
- Tensor parallelism without FSDP (`parallelize_module`): the parameters, their gradients and optimizer
  states are DTensors, placed over their mesh by `adapters/dtensor.py` (full-parameter statistics, one
  writer); a rank's own gradient piece is its pre-reduce row, labelled. The model's plain parameters are
  then copies on every rank (the same data reaches every tensor-parallel rank), written once; under
  pipelining, copies on the ranks of the same stage only (`dtensor.copies_among`: the mesh's "tp"
  dimension, not its "pp"), written once per stage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Replicated, TensorPiece, writes_rows
from trainermon.names import clean_name
from trainermon.runtime.clip_watch import torch_clip_entries

from .base import GRAD_REDUCED, GRAD_UNREDUCED, PARAM, Adapter, AdapterContext, MonitoredParam
from .common import hook_optimizer_step, is_wrapper, state_values, unscaled_grads, unwrap
from .ddp_find import ddp_among_wrappers
from .ddp_taps import DdpReduceTaps
from .dtensor import (
    copies_among,
    dtensor_piece,
    is_dtensor,
    local_piece,
    reduce_partials,
    splits_over_ranks,
    stage_lines,
)
from .pipelining import StageMap
from .zero_redundancy import zero_state

logger = logging.getLogger("trainermon")


class TorchAdapter(DdpReduceTaps, Adapter):
    name = "torch"
    pipelined = True

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        super().__init__(chunks, optimizer, context)
        # the DDP may sit under other wrappers (torch.compile(DDP(m)): the compiled wrapper's _orig_mod)
        self._ddps = [d for d in map(ddp_among_wrappers, self.chunks) if d is not None]
        self._roots = [unwrap(c) for c in self.chunks]
        # or around the module passed (set_monitor(m) while DDP(m) trains): found among live objects, once
        if not self._ddps:
            self._find_ddps()
        self._replica = self._replica_of(context.dp_group)
        self._params: list[MonitoredParam] | None = None
        self._mark: tuple[int, int] = (0, 0)
        self._slots: list[tuple[dict, str, Any]] = []
        self._sizes: list[tuple[dict, int]] = []  # each module's child and parameter dicts, and their size
        #: the last `new_parameters()` re-mapped or dropped parameters (said in its own warning): the
        #: selection is rebuilt although nothing became trainable (runtime.growth)
        self.replaced = False
        self._stages: StageMap | None = None  # which ranks hold this pipeline stage: `agree`
        self._tensor_parallel = splits_over_ranks([p for c in self._roots for p in c.parameters()])
        self._plain_copies = self._tensor_parallel and self._replica is LOCAL
        if self._plain_copies:
            self._replica = Replicated(None)  # plain parameters beside DTensor ones: copies on every rank
        self._init_taps()  # the DDP taps' state (ddp_taps)
        self._zero = zero_state(optimizer)  # ZeroRedundancyOptimizer: state whole on each owning rank

    def _replica_of(self, dp_group: Any) -> Placement:
        if self._ddps and dp_group is None:
            dp_group = self._ddps[0].process_group
        return Replicated(dp_group) if (self._ddps or dp_group is not None) else LOCAL

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        return all(isinstance(c, torch.nn.Module) for c in chunks)

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def torch_ddps(self) -> list[Any]:
        # also those under other wrappers or around the given module, and one found late (_late_ddps)
        return list(self._ddps)

    def agree(self, group: Any, failed: bool = False) -> None:
        import torch.distributed as dist

        lines = None
        if self._plain_copies:  # under pipeline stages, copies only on the ranks of this stage
            # the mesh is read before the ranks compare stages: a failure on one rank is told to every
            # rank in that comparison, and all keep copies over every rank alike
            try:
                meshes = (p.device_mesh for c in self._roots for p in c.parameters() if is_dtensor(p))
                mesh = next(meshes, None)
                if mesh is not None:
                    lines = stage_lines(mesh, dist.get_world_size(group) if group is not None else None)
            except Exception as exc:  # noqa: BLE001 - the collective below runs all the same
                self.context.faults.record("pipeline stage comparison", exc, "no stage map on any rank")
                failed = True
        super().agree(group, failed)
        if lines is not None:
            self._replica = copies_among(lines, self._stages)

    @property
    def splits_model(self) -> bool:
        # pipeline stages hold different parameters: the global norm sums every stage's rows
        return self._tensor_parallel or (self._stages is not None and self._stages.splits())

    @property
    def grads_alike_on_every_rank(self) -> bool:
        """Every rank holds the same gradients after backward (DDP all-reduced them, and no rank holds
        another part of the model): a decision taken from them is the same on every rank."""
        return bool(self._ddps) and not self.splits_model

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return is_wrapper(module)

    def parameters(self) -> list[MonitoredParam]:
        if self._params is None:
            out: list[MonitoredParam] = []
            for vpp_stage, name, p in self._trainable():
                out.append(MonitoredParam(len(out), vpp_stage, name, p))
            self._params = out
            self._every = [p for root in self._roots for p in root.parameters()]
            self._mark = self._trainable_mark()
            self._slots, self._sizes = self._holders()
            self._say_parameters_outside_the_optimizer(out)
            self._say_held_unreduced(out)  # frozen when DDP was built, trainable now: not reduced
        return self._params

    def _trainable(self) -> list[tuple[int, str, torch.nn.Parameter]]:
        return [
            (vpp_stage, clean_name(name), p)
            for vpp_stage, root in enumerate(self._roots)
            for name, p in root.named_parameters()
            if p.requires_grad
        ]

    def _holders(self) -> tuple[list[tuple[dict, str, Any]], list[tuple[dict, int]]]:
        """(dict, key, object) for every module and parameter slot of the model: all still hold their
        object unless a module or a parameter was replaced (`m.w = nn.Parameter(...)`, HF
        `resize_token_embeddings`, a LoRA merge); and (dict, size) of each module's child and parameter
        dicts, which grow when a module or parameter is added (`model.late = nn.Linear(...)`, whose
        parameters no other count sees when no optimizer holds them)."""
        slots: list[tuple[dict, str, Any]] = []
        sizes: list[tuple[dict, int]] = []
        for root in self._roots:
            for module in root.modules():
                if isinstance(module, torch.jit.ScriptModule):  # its slots are fixed (and hold no `get`)
                    continue
                sizes.append((module._modules, len(module._modules)))
                sizes.append((module._parameters, len(module._parameters)))
                slots.extend((module._modules, k, c) for k, c in module._modules.items())
                slots.extend((module._parameters, k, q) for k, q in module._parameters.items())
        return slots, sizes

    def _say_parameters_outside_the_optimizer(self, params: list[MonitoredParam]) -> None:
        """A second optimizer's parameters (a GAN's, a sparse embedding's) are read around the monitored
        optimizer's step, not theirs: their gradients are those they hold then, param_updated equals
        param_origin, and there is no state row. Said once. An optimizer that holds none of the model's
        parameters (fp32 master copies, or another model's optimizer) gets its own sentence: neither case
        has state rows, and param_updated is read at its step, before any copy back."""
        held, outside = self._outside_the_optimizer(params)
        if held and params and len(outside) == len(params):
            logger.warning(
                "trainermon: the monitored optimizer holds none of the model's %d trainable parameters (it "
                "holds %d others: fp32 master copies, or another model's optimizer?): no optimizer-state "
                "rows (mv_distribution), and param_updated is read right after its step, before any copy "
                "back into the model (equal to param_origin when nothing else updated the model by then)",
                len(params),
                held,
            )
        if held and outside and len(outside) < len(params):
            logger.warning(
                "trainermon: %d trainable parameters are not in the monitored optimizer (%s): their "
                "grad_*/param_origin/param_updated rows are read around that optimizer's step (the "
                "gradients they hold then), not the one that updates them, and they have no "
                "optimizer-state rows while they are not in it (parameters added to it later with "
                "add_param_group are followed from that step on)",
                len(outside),
                _listed(outside),
            )

    def _outside_the_optimizer(self, params: list[MonitoredParam]) -> tuple[int, list[str]]:
        """(how many parameters the monitored optimizer holds, the names of `params` it does not hold)."""
        held = {id(p) for g in getattr(self.optimizer, "param_groups", ()) for p in g.get("params", ())}
        return len(held), [mp.name for mp in params if id(mp.param) not in held]

    def _trainable_mark(self) -> tuple[int, int]:
        """The count of trainable parameters and of the optimizer's: a cheap test (one pass over the
        flags of a list kept since the last scan, ~10 us for 200 parameters; walking the modules again
        cost ~1 ms on a 48-layer model), on collected steps only, before any rescan. Parameters of
        modules added to the model later are found by `new_parameters`' sizes of the module dicts."""
        return (
            sum(p.requires_grad for p in self._every),
            sum(len(g["params"]) for g in getattr(self.optimizer, "param_groups", ())),
        )

    def dicts_unchanged(self) -> bool:
        """No module's child or parameter dict changed size since the last scan (one `len` per module)."""
        return all(len(d) == n for d, n in self._sizes)

    def new_parameters(self) -> list[MonitoredParam]:
        """Parameters that became trainable, or were added to the model (a new module, held by an
        optimizer or not); `replaced` tells whether others were re-mapped (the model now holds another
        tensor under their name) or dropped, so that the selection is rebuilt. Costs, on collected steps
        only (never on the others): the count of flags, one size check per module's child and parameter
        dict and one identity check per slot (~40 us for 770 slots); a rescan (~1 ms on a 48-layer
        model) only when one of them changed."""
        known = self.parameters()
        self.replaced = False
        mark = self._trainable_mark()
        if mark == self._mark and self.dicts_unchanged() and all(d.get(k) is o for d, k, o in self._slots):
            return []
        self._every = [p for root in self._roots for p in root.parameters()]
        self._mark = self._trainable_mark()  # of the new list: counts modules added since the last scan
        self._slots, self._sizes = self._holders()
        found = self._trainable()
        # every parameter, frozen too: a frozen one keeps its entry, as before
        named = [
            (v, clean_name(n), p) for v, root in enumerate(self._roots) for n, p in root.named_parameters()
        ]
        by_name = {(v, n): p for v, n, p in named}
        by_id = {id(p): (v, n) for v, n, p in named}
        kept: list[MonitoredParam] = []
        remapped: list[MonitoredParam] = []
        dropped: list[str] = []
        renamed: list[str] = []
        for mp in known:
            p = by_name.get((mp.vpp_stage, mp.name))
            if p is None and id(mp.param) in by_id:  # the same tensor under another name (a wrapper put
                v, name = by_id[id(mp.param)]  # around its module, a LoRA base_layer): kept, renamed
                kept.append(dataclasses.replace(mp, index=len(kept), vpp_stage=v, name=name))
                renamed.append(f"{mp.name} -> {name}")
            elif p is None:  # its module is gone: a dead tensor gives stale rows
                dropped.append(mp.name)
            elif p is mp.param:
                kept.append(dataclasses.replace(mp, index=len(kept)) if dropped else mp)
            else:  # replaced under the same name: read the tensor the model now holds
                kept.append(dataclasses.replace(mp, index=len(kept), param=p))
                remapped.append(kept[-1])
        ids = {id(mp.param) for mp in kept}
        new: list[MonitoredParam] = []
        for vpp_stage, name, p in found:
            if id(p) not in ids:
                ids.add(id(p))
                new.append(MonitoredParam(len(kept) + len(new), vpp_stage, name, p))
        if remapped or dropped:
            logger.warning(
                "trainermon: parameters replaced in the model: re-mapped %s; dropped %s (rows from now on "
                "read the tensors the model holds)",
                ", ".join(mp.name for mp in remapped[:8]) or "none",
                ", ".join(dropped[:8]) or "none",
            )
        if renamed:
            logger.info("trainermon: parameters moved in the model, their rows renamed: %s", _listed(renamed))
        if remapped or dropped or renamed:
            self._disarm()  # the pre-reduce taps sit on the old tensors, keyed by the old indices
        known[:] = kept + new
        if new:
            self._say_new_outside_the_optimizer(new)
        if new and self._ddps and not self._tensor_parallel:
            self._say_unreduced([mp for mp in new if id(mp.param) not in self._held])
            self._disarm()  # re-armed at the next collected step, with taps on the new ones too
        self.replaced = bool(remapped or dropped or renamed)  # the caller rebuilds the selection
        return new

    def _say_new_outside_the_optimizer(self, new: list[MonitoredParam]) -> None:
        """Parameters found after set_monitor that the monitored optimizer does not hold (a module added
        to the model, or unfrozen, without `add_param_group`): monitored as those outside it at
        set_monitor are, said once per rescan that finds them. A set of the optimizer's ids: rescans only."""
        held, outside = self._outside_the_optimizer(new)
        if held and outside:
            logger.warning(
                "trainermon: %d trainable parameters found after set_monitor are not in the monitored "
                "optimizer (%s): they are monitored, their grad_*/param_origin/param_updated rows read "
                "around that optimizer's step, with no optimizer-state rows until they are given to it "
                "(add_param_group)",
                len(outside),
                _listed(outside),
            )

    def holds_every_grad_row(self) -> bool:
        """Whether this rank's grad_reduced rows make the whole model's (its global norm is then its own
        total): not where DDP leaves parameters unreduced (trainable only after it was built: every rank
        writes its own rows for them) and another rank writes the reduced ones. A set test on collected
        steps; the writer test (a group rank) only with unreduced parameters."""
        if not self._unreduced or self._tensor_parallel or type(self._replica) is not Replicated:
            return True
        return writes_rows(self._replica)

    def attach_step(self, events: Any) -> list[Any]:
        return [] if self.optimizer is None else hook_optimizer_step(self.optimizer, events)

    def clip_entries(self) -> Sequence[Any]:
        return torch_clip_entries()

    def single_replica(self) -> bool:
        if not self._looked_late and self._taps is not None and not self._ddps:
            self._late_ddps()  # once: a DDP made after set_monitor (a flag test on later steps)
        return self._replica is LOCAL and not self._tapped and not self._tensor_parallel

    # ---- reads --------------------------------------------------------------------------------
    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        if kind == GRAD_UNREDUCED:  # read at the step (as grad_reduced): unscaled as the optimizer sees it
            grads = unscaled_grads(self.optimizer, [mp.param.grad for mp in params])
            return [None if g is None else self._own(g) for g in grads]
        if self._zero is not None and kind not in (GRAD_REDUCED, PARAM):
            return self._zero.read(params, kind)
        tensors = self._tensors(kind, params)
        if self._tensor_parallel:  # Partial tensors (sequence parallelism's norm grads) reduced together
            return [self._piece(t) for t in reduce_partials(tensors)]
        replica, own = self._replica, self._unreduced
        if own:  # parameters DDP does not reduce: this rank's own (see _say_unreduced)
            places = [LOCAL if id(mp.param) in own else replica for mp in params]
            return [
                None if t is None else TensorPiece(t, w, tuple(t.shape), t.dtype)
                for t, w in zip(tensors, places)
            ]
        return [None if t is None else TensorPiece(t, replica, tuple(t.shape), t.dtype) for t in tensors]

    def read_whole(
        self, kind: str, params: Sequence[MonitoredParam]
    ) -> tuple[Placement, list[torch.Tensor | None]] | None:
        # No DTensor anywhere: every tensor is whole, with the model's one placement (never sharded)
        if self._tensor_parallel or kind == GRAD_UNREDUCED:
            return None
        if self._zero is not None and kind not in (GRAD_REDUCED, PARAM):  # state: owners' pieces
            return None
        if self._unreduced and any(id(mp.param) in self._unreduced for mp in params):
            return None  # mixed placements: per tensor through `read`
        return self._replica, self._tensors(kind, params)

    def _tensors(self, kind: str, params: Sequence[MonitoredParam]) -> list[torch.Tensor | None]:
        if kind == GRAD_REDUCED:  # a fused optimizer's loss scale is divided out in its kernel: here too
            return unscaled_grads(self.optimizer, [mp.param.grad for mp in params])
        if kind == PARAM:
            return [mp.param.data for mp in params]
        return state_values(self.optimizer, [mp.param for mp in params], kind)

    def _piece(self, t: torch.Tensor | None) -> TensorPiece | None:
        if t is None:
            return None
        # DTensor values exist only in a tensor-parallel model: no type check per tensor otherwise
        if self._tensor_parallel and is_dtensor(t):
            return dtensor_piece(t)
        return TensorPiece.whole(t, self._replica)

    def _own(self, grad: torch.Tensor) -> TensorPiece:
        if self._tensor_parallel and is_dtensor(grad):
            return local_piece(grad)
        return TensorPiece.whole(grad, LOCAL)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
