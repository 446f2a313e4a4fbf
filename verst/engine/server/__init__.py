"""The engine's HTTP face: SGLang's native protocol (`sglang_api`), the OpenAI-compatible routes
(`openai_api`) and the aiohttp app and `verst serve` (`app`)."""
