"""The budget controller's experiments: the adaptive budget against every static one on a phase-shifting
workload. They drive the controller's decision core (stallfree.operator.controller.decide) from outside;
nothing here runs in a cluster.

- `sim`: `python -m experiments.phase.sim`, the workload, the simulated replica, scoring and plots.
- `live`: `python -m experiments.phase.live`, the same on real `stallfree up` deployments.
- `rounds`: repeated live rounds in alternating order, medians of the ratios.
"""
