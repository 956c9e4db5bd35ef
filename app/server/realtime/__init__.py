"""Live transcription over WebSocket: the transcription subset of OpenAI's Realtime API."""
