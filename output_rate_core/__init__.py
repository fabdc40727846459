"""What the control plane and the engine extension both speak: the wire protocol, the id
rules, the rate bounds, the policy value and the limit model's inheritance rule, the
ZMQ socket helper, and the HTTP connection guard both servers run (uvicorn is imported only
when a guard is built).

Pure Python: imports neither vLLM nor SQLAlchemy nor FastAPI, nor either side's package.
"""
