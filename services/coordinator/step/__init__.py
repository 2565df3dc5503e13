"""The step wing: one loop per coordinator shard drives each step in flight through its
controller (`core.step_controller`) and writes what it decides (`store`)."""
