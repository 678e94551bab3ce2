"""The benchmarks a user runs: trace replay against a server (`stallfree bench serve`), capacity under SLOs
(`stallfree bench capacity`), fixed-load sweeps (`stallfree bench sweep`), profiling and the cost model
(`stallfree profile`), budget tuning (`stallfree tune`) and a discrete-event simulator on the real scheduler
(`stallfree simulate`).

Modules: traces (lengths, scaling, arrivals), metrics (records, percentiles, goodput), simulator (the
discrete-event loop), capacity (expand-then-bisect search), loadgen (async OpenAI client), launcher (starts
`stallfree serve`), and one module per command. The cost model they profile and simulate with is
stallfree.costmodel, shared with the budget controller. The experiments that produced the docs' figures
(the controller's phase-shift runs, the capacity study, engine micro-benchmarks) import these modules from
the repository's experiments/ folder; nothing here imports them.
"""
