"""The continuous-batching engine: scheduler, model runner, sampler. No Ray imports."""
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine, QueueFullError
from server.engine.errors import InvalidRequestError
from server.engine.request import RequestOutput
from server.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "InvalidRequestError", "LLMEngine", "QueueFullError", "RequestOutput", "SamplingParams"]
