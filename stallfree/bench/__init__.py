"""Benchmarks that answer the paper's questions: trace replay against a server (`stallfree bench serve`),
capacity under SLOs (`stallfree bench capacity`), profiling and the cost model (`stallfree profile`),
budget tuning (`stallfree tune`), a discrete-event simulator on the real scheduler (`stallfree simulate`) and
the budget controller's experiments (`stallfree phase-sim`, `stallfree phase-live`).

Modules: traces (lengths, scaling, arrivals), metrics (records, percentiles, goodput), simulator (the
discrete-event loop), capacity (expand-then-bisect search), loadgen (async OpenAI client), launcher (starts
`stallfree serve`), phase (the controller experiments), and one module per command. The cost model they
profile and simulate with is stallfree.costmodel, shared with the budget controller.
"""
