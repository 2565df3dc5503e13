"""What the tests and the benchmarks use to drive spotrl, and the runtime does not: a local
deployment they can restart services of (`deploy`) and a headless browser on the dashboard
(`browser`). No module under `services` imports this package (import-linter checks it)."""
