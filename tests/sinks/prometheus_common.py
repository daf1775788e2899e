"""Shared by the test_prometheus*.py modules: a monitored run with the exporter on, scraping its page."""

from __future__ import annotations

import json
import os
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from trainermon import TrainerMon


def train_step(model, opt, gen, scale: float = 1.0) -> dict[str, torch.Tensor]:
    (model(torch.randn(4, 6, generator=gen)).pow(2).mean() * scale).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return grads


def url_of(mon: TrainerMon) -> str:
    with open(os.path.join(mon.run_dir, "prometheus.json")) as fh:
        return json.load(fh)["url"]


def scrape(url: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, metric: str, **labels) -> float:
    key = (metric, tuple(sorted({"rank": "0", **{k: str(v) for k, v in labels.items()}}.items())))
    return samples[key]
