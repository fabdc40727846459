"""What the control plane and the engine extension both speak: the wire protocol, the id
rules, the rate bounds, the policy value and the limit model's inheritance rule, and the
ZMQ socket helper.

Pure Python: imports neither vLLM nor SQLAlchemy nor FastAPI, nor either side's package.
"""
