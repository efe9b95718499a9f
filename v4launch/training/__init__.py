"""The training job that runs on each rank: optimizer, schedule, curriculum, metrics."""
