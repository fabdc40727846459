.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
bench:
	bash scripts/bench.sh
