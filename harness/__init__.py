"""Real parts to drive, shared by the tests and the benchmarks (never shipped).

- ``scheduler``: the real vLLM 0.32.0 schedulers built in-process on the CPU,
  requests, hand-built model-runner outputs (the only fake) and a fake clock.
- ``servers``: real ``vllm`` server processes on the tiny local model, ports.
- ``client``: an OpenAI-API streaming client that times every token.
- ``cpu_async_server``: the launcher that keeps ``--async-scheduling`` on on CPU.
"""
