"""vLLM's error body mapped to a profile error (:func:`vllm_nnrp_plugin.vllm_binding.serving.error_from_body`)."""

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.vllm_binding.serving import error_from_body


def test_message_is_vllm_s():
    error = error_from_body({"message": "bad temperature", "type": "BadRequestError", "param": None, "code": 400})
    assert (error.code, error.message, error.status) == (E.INVALID_REQUEST, "bad temperature", 400)


def test_a_body_without_message_names_its_type_not_none():
    error = error_from_body({"type": "BadRequestError", "param": None, "code": 400})
    assert error.message == "BadRequestError"


def test_404_on_model_is_model_not_found():
    error = error_from_body({"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404})
    assert (error.code, error.status) == (E.MODEL_NOT_FOUND, 404)
