"""Loads an engine directory and generates with it: KV block pool, engine runner, sampler, generation loop."""
