"""Several replicas' Prometheus text as one exposition, each sample labelled with its replica, so that
counters add up across replicas in any Prometheus query (sum by metric name)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return self._families


def merge_replica_metrics(texts: dict[str, bytes]) -> bytes:
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                target.add_sample(
                    sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp, sample.exemplar
                )
    registry = CollectorRegistry()
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
