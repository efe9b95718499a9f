"""v4launch: validate, run and launch DeepSeek-V4-style training recipes."""
