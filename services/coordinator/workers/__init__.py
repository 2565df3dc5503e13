"""The workers as the coordinator sees them: which worker signed a delta batch (`keys`) and
what the observer makes of their heartbeats (`observer`)."""
