"""The scheduler's Prometheus view: queue depth, per-worker load, placements, migrations, rejections.

Everything is read from the SchedulerCore at scrape time (it already keeps these numbers for
GetStatus); scrapes run on the scheduler's event loop, between its other tasks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from metroserve.worker.metrics import PREFIX

if TYPE_CHECKING:
    from metroserve.scheduler.core import SchedulerCore


class SchedulerCollector:
    def __init__(self, scheduler: SchedulerCore):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        queue = GaugeMetricFamily(PREFIX + "scheduler_queue_depth", "Sequences waiting for a worker slot.")
        queue.add_metric([], len(s.queue))
        yield queue
        active = GaugeMetricFamily(PREFIX + "scheduler_active_requests", "Requests admitted and not finished.")
        active.add_metric([], len(s.requests))
        yield active
        workers = GaugeMetricFamily(PREFIX + "scheduler_workers", "Connected workers (draining ones included).")
        workers.add_metric([], len(s.workers))
        yield workers

        per_worker = {
            "worker_num_requests_running": ("Sequences running on the worker (its last load report).",
                                            lambda w: w.load.num_running),
            "worker_num_requests_waiting": ("Sequences waiting on the worker (its last load report).",
                                            lambda w: w.load.num_waiting),
            "worker_kv_cache_usage_perc": ("Fraction of the worker's KV blocks in use.",
                                           lambda w: 1.0 - w.load.num_free_blocks / max(1, w.load.num_total_blocks)),
            "worker_placed_seqs": ("Sequences the scheduler has placed on the worker and not seen end.",
                                   lambda w: w.num_placed_seqs),
            "worker_draining": ("1 while the worker drains.", lambda w: int(w.draining)),
        }
        for name, (doc, value) in per_worker.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            for w in s.workers.values():
                family.add_metric([w.worker_id], value(w))
            yield family

        placements = CounterMetricFamily(PREFIX + "scheduler_placements", "Placements made, by worker.",
                                         labels=["worker"])
        hit_tokens = CounterMetricFamily(PREFIX + "scheduler_placement_prefix_hit_tokens",
                                         "Prompt tokens the chosen worker already held when placed, by worker.",
                                         labels=["worker"])
        for worker_id in sorted(s.placements_by_worker):
            placements.add_metric([worker_id], s.placements_by_worker[worker_id])
            hit_tokens.add_metric([worker_id], s.placement_hit_tokens_by_worker[worker_id])
        yield placements
        yield hit_tokens
        migrations = CounterMetricFamily(PREFIX + "scheduler_migrations",
                                         "Placements re-placed after their worker was lost or handed them back.")
        migrations.add_metric([], s.num_migrations)
        yield migrations
        rejections = CounterMetricFamily(PREFIX + "scheduler_rejections", "Requests refused at admission, by code.",
                                         labels=["code"])
        for code in sorted(s.rejections):
            rejections.add_metric([code], s.rejections[code])
        yield rejections
