"""Real parts to drive, shared by the tests and the benchmarks (never shipped).

- ``scheduler``: the real vLLM schedulers (of the release imported) built in-process on
  the CPU, requests, hand-built model-runner outputs (the only fake) and a fake clock.
- ``vllm_release``: which vLLM a test session imports, checked against the release a
  run is for (scripts/test_vllm_releases.sh).
- ``upstream_tests``: a pytest plugin that runs vLLM's own scheduler tests with the
  output-rate schedulers swapped in.
- ``servers``: real ``vllm`` server processes on the tiny local model, ports.
- ``control_plane``: empty or migrated databases (SQLite, a PostgreSQL schema) and
  ``output-rate serve`` as a subprocess; the admin token both use.
- ``applying_engine``: a real push client applying what arrives on a thread of its
  own, as an engine core does, without vLLM.
- ``scripted_server``: a push server a test drives frame by frame.
- ``client``: an OpenAI-API streaming client that times every token.
- ``http_clients``: hostile clients on a raw socket (a head that never ends).
- ``prometheus``: a real Prometheus (Debian's package) as a process on a random port.
- ``cpu_async_server``: the launcher that keeps ``--async-scheduling`` on on CPU.
"""
