"""Engine: the step loop (core), the offline LLM API, text assembly."""
