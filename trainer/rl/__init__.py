"""Reinforcement learning from rewards (GRPO, models/objectives/grpo.py): the reward functions and one generation's
rollout (sample, score, advantages, the learner's rows)."""
