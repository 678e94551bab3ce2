"""The iteration cost model T(n_prefill, n_decode, context), in one place for its three users: the profiler
(`stallfree profile`, which fits it), the simulator (which advances its clock by it) and the budget controller
(which plans token budgets with it). It belongs to none of them, and imports none of them.

- `features`: what an iteration is made of, as the fit's features: from the scheduler's chunks (profiler,
  simulator), from a hypothetical iteration (tune), or from a controller's aggregate reading.
- `fitted`: `FittedCostModel`, a fit's coefficients (cost_model.json), and its spec.controller.costModel text.
- `fit`: the least-squares fit and its error report (the profiler's part).
- `model`: `CostModel`, the interface the controller plans with: the built-in linear shape, a profile behind
  it, and loading either from a file or from a SarathiDeployment's coefficients.
- `planning`: budgets and prefill capacity that a model predicts (largest budget within a time, smallest
  budget serving a demand).
"""
