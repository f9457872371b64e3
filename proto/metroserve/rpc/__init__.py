"""metroserve's gRPC contracts: generated stubs (*_pb2*.py, from the .proto files here) and the
constants every side of a channel agrees on."""

# The scheduler process runs grpc's older poller for its listening socket and client connections
# (services/cli.py sets GRPC_EXPERIMENTS to this before grpc starts, unless the user set it).
# grpc's EventEngine passes each message through more threads: measured on a 2-core VM (a
# bidirectional stream, one small message each way 25 times a second), 12.5 context switches and
# 530-650 us of server CPU per round trip with it, 6.5 and 400-440 us without; in `bench cluster`
# the scheduler's CPU per request fell by about 20%. Only the scheduler: with every process on
# the older poller (and no BDP probes), the served path on a 2-core VM measured 0.913 of offline
# against 0.968 with the defaults (one run each): it stays off the token path.
SCHEDULER_GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_client"

# The health status of this service name is readiness (a worker is serving); "" is liveness.
GENERATION_SERVICE = "metroserve.v1.Generation"
# Trailing metadata of an INVALID_ARGUMENT: the request field at fault (OpenAI's error "param").
PARAM_METADATA_KEY = "metroserve-param"
# A worker's first report lists every cached block (16 bytes each): allow large messages.
# Keepalive pings notice a peer whose host vanished without closing the connection: a client (a
# worker or gateway dialing the scheduler, a gateway dialing a worker) within 15 s, so it redials.
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000)]
# Servers ping less often: each ping costs the scheduler a wakeup (about 0.25 ms of CPU on a 2-core
# VM; 64 workers' connections pinged both ways every 10 s cost it ~3 ms/s idle), and a vanished
# worker is noticed by its heartbeat timeout anyway. A vanished gateway's connection is dropped
# within 35 s, then its requests get their grace period.
SERVER_GRPC_OPTIONS = [*(o for o in GRPC_OPTIONS if o[0] != "grpc.keepalive_time_ms"),
                       ("grpc.keepalive_time_ms", 30_000)]
# Many workers dial one scheduler, and each of their pings wakes it too: a worker pings the
# scheduler as seldom as servers ping (64 workers at 10 s: 6.4 wakeups a second, ~2 ms/s of the
# scheduler's CPU). It notices a vanished scheduler host within 35 s; its output keeps streaming
# to the gateways meanwhile, and the scheduler notices a vanished worker by its heartbeat timeout.
# No BDP probing at the scheduler: it grows a connection's flow-control window for bulk transfers
# with pings of its own, and the scheduler's connections carry small messages (under 2 gateways
# the probes made 1.45 scheduler sends per request against 1.10 without, strace counts).
SCHEDULER_GRPC_OPTIONS = [*SERVER_GRPC_OPTIONS, ("grpc.http2.bdp_probe", 0)]
WORKER_TO_SCHEDULER_GRPC_OPTIONS = SCHEDULER_GRPC_OPTIONS
