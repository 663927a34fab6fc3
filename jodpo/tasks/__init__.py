"""Tasks: prompts and the rewards that judge their completions (a task module per task)."""
