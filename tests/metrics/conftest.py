"""Metrics-test helpers: scrape a live `/metrics` endpoint over HTTP and look samples up."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape of an endpoint: every sample, by name and labels."""

    def __init__(self, port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        """The value of one sample; KeyError if the endpoint does not expose it."""
        return self.samples[(name, frozenset(labels.items()))]

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.samples

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for n, labels in self.samples if n == name]
