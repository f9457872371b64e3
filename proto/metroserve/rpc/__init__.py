"""metroserve's gRPC contracts: generated stubs (*_pb2*.py, from the .proto files here) and the
constants every side of a channel agrees on."""

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
