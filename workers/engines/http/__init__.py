"""What the HTTP engines share: the async client with retries and batching on a private loop."""
