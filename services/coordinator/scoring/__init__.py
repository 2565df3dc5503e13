"""The scoring wing: rewards of finished responses and the environments of multi-turn
episodes, each in processes of their own."""
