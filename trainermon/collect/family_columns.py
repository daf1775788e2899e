"""Columns that single families have beyond the statistics (no torch here: the offline tools read it).

Each is (name, kind): kind "float" (float64, NaN/null elsewhere), "int" (int64, null elsewhere), "list"
(a list of int64 per row) or "flist" (a list of float64 per row; CSV: JSON with NaN). CSV appends them,
in this order, after `shard` in that family's files;
Parquet has every one at the end of its schema (`EXTRA_COLUMNS`), null in the other families' rows."""

from __future__ import annotations

FAMILY_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "update": (("ratio", "float"),),  # ||dw|| / ||w_before||
    "moe_load": (
        ("load_cv", "float"),  # coefficient of variation of the per-expert load (std / mean)
        ("max_expert", "int"),  # the most loaded expert (lowest index on ties)
        ("min_expert", "int"),  # the least loaded expert
        ("dropped", "float"),  # tokens the router dropped (capacity factor); NaN where it reports none
        ("aux_loss", "float"),  # the router's load-balancing loss (mean over micro-batches and ranks)
        ("expert_load", "list"),  # tokens routed to each expert, summed over the ranks that routed them
    ),
    "attn_logit": (
        ("max_head", "int"),  # the (global) head with the largest logit (lowest index on ties)
        ("head_max_logit", "flist"),  # each head's largest pre-softmax logit of the step
    ),
}
#: Every family column once, in the order of the Parquet schema, with its kind and its families.
EXTRA_COLUMNS: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (name, kind, tuple(f for f, cols in FAMILY_COLUMNS.items() if any(c == name for c, _ in cols)))
    for name, kind in dict.fromkeys(col for cols in FAMILY_COLUMNS.values() for col in cols)
)
