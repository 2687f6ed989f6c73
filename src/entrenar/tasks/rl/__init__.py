"""Online RL with verifiable rewards (GRPO and its variants) as a task on the one loop."""
