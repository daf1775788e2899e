"""The monitor's configuration as typed, frozen sections: msprobe's keys with msprobe's meaning, plus
trainermon's own. These dataclasses hold the only defaults; `parse.parse_config` is the only way user input
becomes one of them (every check is there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainermon.stats.table import nan_only, needs_nonfinite, needs_zeros


@dataclass(frozen=True)
class AlertConfig:
    """msprobe's `alert` section plus `escalate_steps`: after an anomaly outside the activations, collect
    every module's activations for this many steps (0: off). `dump` writes each anomaly to
    `anomaly_detected/anomaly_rank{R}.jsonl` (msprobe's meaning); anomalies are logged and counted either
    way."""

    rules: tuple[dict, ...] = ()
    dump: bool = False
    escalate_steps: int = 0


@dataclass(frozen=True)
class ParquetConfig:
    """A part file is completed every `steps_per_part` collected steps, or when a family buffers
    `rows_per_part` rows, or `seconds_per_part` after the first buffered row (None: no time limit)."""

    dir: str | None = None  # dataset root under MONITOR_OUTPUT_DIR (relative, no '..'); None = "parquet"
    steps_per_part: int = 1000
    rows_per_part: int = 250_000
    seconds_per_part: float | None = 300.0
    compression: str = "zstd"
    compression_level: int | None = None


@dataclass(frozen=True)
class PrometheusConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; > 0: base port, the endpoint listens on port + LOCAL_RANK
    advertise_host: str | None = None  # host in the file_sd target; None = host (or FQDN if 0.0.0.0)
    sd_dir: str | None = "prometheus_sd"  # file_sd target files, relative to MONITOR_OUTPUT_DIR; None = none
    per_parameter: bool = False
    stats: tuple[str, ...] | None = None  # None = the numeric ops of the config
    families: tuple[str, ...] | None = None  # None = every family
    max_series: int = 10_000
    #: Per-rank families (actv, actv_grad, grad_unreduced) from every rank; false: only the rows of the
    #: modules named in `targets` (with one rank: all), the cross-rank summaries stand for the rest.
    per_rank: bool = False
    #: Seconds of collected steps `trainermon_global_grad_norm_max` covers (the largest global gradient
    #: norm among them): at least a scrape interval, so that a spike of one step is seen by a scrape.
    max_window_s: float = 60.0


#: Collectives `cc_distribution` can watch (trainermon's `cc_distribution.ops` picks among them).
COMM_OPS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "funcol",  # torch.distributed._functional_collectives (DTensor, torch.compile eager)
)


@dataclass(frozen=True)
class CommConfig:
    """msprobe's `cc_distribution` section (`enable`, `cc_codeline`, `cc_pre_hook`, `cc_log_only`) plus
    trainermon's `ops` (which collectives; None = all of COMM_OPS) and `check` (invariant checks of the
    collectives, one extra small reduction per collected step). `cc_log_only` lists call sites and keeps
    training (msprobe stops the run)."""

    enable: bool = False
    cc_codeline: tuple[str, ...] = ()  # regexes matched against "path:line" of the call site
    cc_pre_hook: bool = False  # also the inputs' statistics
    cc_log_only: bool = False
    ops: tuple[str, ...] | None = None
    check: bool = True


@dataclass(frozen=True)
class AttnLogitConfig:
    """`attn_logit_distribution`: true / false, or {"enable": bool, "sample": N}. `sample`: query
    positions measured per sequence (all of a sequence with at most N, else N evenly spaced ones)."""

    enable: bool = False
    sample: int = 256


@dataclass(frozen=True)
class MonitorConfig:
    """Validated monitor configuration. Field names are msprobe's config keys (and trainermon's own)."""

    targets: dict[str, dict] = field(default_factory=dict)
    module_ranks: tuple[int, ...] = ()
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    print_struct: bool = False
    xy_distribution: bool = False
    all_xy: bool = False
    forward_only: bool = False
    backward_only: bool = False
    wg_distribution: bool = False
    monitor_mbs_grad: bool = False
    mv_distribution: bool = False
    param_distribution: bool = False
    cc_distribution: CommConfig = field(default_factory=CommConfig)
    alert: AlertConfig = field(default_factory=AlertConfig)
    ops: tuple[str, ...] = ("norm", "shape", "dtype")
    eps: float = 1e-8
    ndigits: int = 6
    format: tuple[str, ...] = ("csv",)
    step_count_per_record: int = 1
    dynamic_on: bool = False
    stack_info: bool = False
    squash_name: bool = False
    # trainermon's own keys
    queue_size: int = 64
    #: MiB of hook tensors (activations, their gradients) an accelerator keeps alive by reference for one
    #: batched statistics call; 0: each hook's tensors are reduced before it returns (least memory, one
    #: call per hook). The CPU's hold is fixed at 2 MiB (its cache).
    accelerator_hold_mib: int = 256
    write_interval_s: float = 0.5  # how often the worker writes what is waiting; 0 = after every step
    dynamic_watch: str = "inotify"  # how the config file is watched in dynamic mode: inotify or polling
    parquet: ParquetConfig = field(default_factory=ParquetConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    #: Cross-rank summaries of actv, actv_grad and grad_unreduced (family `xrank`, written by rank 0);
    #: only with more than one rank.
    xrank_summary: bool = True
    # training-health families (off by default)
    update_distribution: bool = False  # family `update`: statistics of this step's update, and ||dw||/||w||
    moe_distribution: bool = False  # family `moe_load`: tokens per expert of every MoE router
    #: family `attn_logit`: per layer and head, the largest pre-softmax attention logit of the step
    attn_logit_distribution: AttnLogitConfig = field(default_factory=AttnLogitConfig)

    # ---- derived views -------------------------------------------------------------------------
    @property
    def wants_nonfinite(self) -> bool:
        """NaN counting is on: min/max/norm/mean then leave NaN out (and Inf, unless `wants_nan_only`)."""
        return needs_nonfinite(self.ops)

    @property
    def wants_nan_only(self) -> bool:
        """`nans` without `infs`: only NaN is left out; infinities stay in norm/min/max/mean."""
        return nan_only(self.ops)

    @property
    def wants_zeros(self) -> bool:
        return needs_zeros(self.ops)

    @property
    def collects_actv(self) -> bool:
        # print_struct records the structure instead (and stops the run after the first step); all_xy
        # only widens xy_distribution's targets to every module (msprobe's meaning): alone it selects nothing
        return self.xy_distribution and not self.backward_only and not self.print_struct

    @property
    def collects_actv_grad(self) -> bool:
        return self.xy_distribution and not self.forward_only and not self.print_struct

    @property
    def collects_optimizer_side(self) -> bool:
        on = (self.wg_distribution, self.mv_distribution, self.param_distribution, self.update_distribution)
        return any(on)

    #: Keys whose change gives new output columns or sinks (a reloaded config opens a new run directory).
    OUTPUT_KEYS = (
        "ops",
        "format",
        "step_count_per_record",
        "ndigits",
        "parquet",
        "prometheus",
        "monitor_mbs_grad",  # grad_unreduced's micro_step column, and msprobe's tag kind for it
    )
