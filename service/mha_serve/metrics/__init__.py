"""Every Prometheus metric of mha-serve, defined in this one package.

One process (the standalone server, a Ray replica) or several: with `--frontend-workers N`
the gRPC frontends and the engine process share prometheus-client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set before this module is first imported): counters and
histograms add up across processes, the two plain gauges say how (`multiprocess_mode`),
and the gauges read live from the engine (queue depth, KV cache, sessions) are one
collector, LIVE, in the engine's process, beside the files (serve_metrics).

The package re-exports (`import X as X`) every public name of its modules, so that callers
write `metrics.X` wherever X lives: definitions.py (the metrics and their buckets),
sessions.py (session ends, the durable series), live.py (the gauges read at scrape time),
requests.py (the per-request series) and exposition.py (/metrics, multiprocess mode).
"""

from __future__ import annotations

from .definitions import BATCH_REQUESTS as BATCH_REQUESTS
from .definitions import BATCH_SIZE as BATCH_SIZE
from .definitions import BATCH_SIZE_BUCKETS as BATCH_SIZE_BUCKETS
from .definitions import COMPUTE_LATENCY as COMPUTE_LATENCY
from .definitions import IN_FLIGHT as IN_FLIGHT
from .definitions import LATENCY_BUCKETS_S as LATENCY_BUCKETS_S
from .definitions import LOST_REASONS as LOST_REASONS
from .definitions import PROTOCOL_KSERVE_V2 as PROTOCOL_KSERVE_V2
from .definitions import PROTOCOL_MHA_V1 as PROTOCOL_MHA_V1
from .definitions import QUEUE_LATENCY as QUEUE_LATENCY
from .definitions import READY as READY
from .definitions import REQUEST_LATENCY as REQUEST_LATENCY
from .definitions import REQUEST_TOKENS as REQUEST_TOKENS
from .definitions import REQUESTS as REQUESTS
from .definitions import RESTORE_BUCKETS_S as RESTORE_BUCKETS_S
from .definitions import RESTORE_LATENCY as RESTORE_LATENCY
from .definitions import SESSION_RESTORES as SESSION_RESTORES
from .definitions import SESSIONS_ADOPTED as SESSIONS_ADOPTED
from .definitions import SESSIONS_ENDED as SESSIONS_ENDED
from .definitions import SESSIONS_LOST as SESSIONS_LOST
from .definitions import SESSIONS_MOVED as SESSIONS_MOVED
from .definitions import SESSIONS_SPILLED as SESSIONS_SPILLED
from .definitions import SPILL_REASONS as SPILL_REASONS
from .definitions import SPILLED_BYTES as SPILLED_BYTES
from .definitions import TOKEN_BUCKETS as TOKEN_BUCKETS
from .definitions import TOKENS as TOKENS
from .definitions import WEIGHTS_BYTES as WEIGHTS_BYTES
from .exposition import MULTIPROC_ENV as MULTIPROC_ENV
from .exposition import ProcessTree as ProcessTree
from .exposition import multiprocess_mode as multiprocess_mode
from .exposition import process_gone as process_gone
from .exposition import serve_metrics as serve_metrics
from .live import LIVE as LIVE
from .live import LiveGauges as LiveGauges
from .live import watch_kv_cache as watch_kv_cache
from .live import watch_queue as watch_queue
from .live import watch_spill as watch_spill
from .requests import attend_observer as attend_observer
from .requests import batch_observer as batch_observer
from .requests import count_request as count_request
from .requests import in_flight as in_flight
from .requests import observe_attend as observe_attend
from .requests import request_counts as request_counts
from .sessions import count_adopted as count_adopted
from .sessions import count_lost as count_lost
from .sessions import count_moved as count_moved
from .sessions import count_session_end as count_session_end
from .sessions import count_spilled as count_spilled
from .sessions import observe_restore as observe_restore
