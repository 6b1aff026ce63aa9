"""The engine loop: requests, the scheduler, model execution and output assembly."""
