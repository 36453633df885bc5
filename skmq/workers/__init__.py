"""The enqueue and dequeue workers: storing producers' messages, dispatching, pushing, answers."""
