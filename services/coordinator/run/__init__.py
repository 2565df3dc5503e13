"""The runs as the coordinator drives them: the run store (queue, states, the release of a
finished run's keys) and Redis memory as a brake on queuing a step."""
