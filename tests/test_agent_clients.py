"""Agent loops and streamed responses through real client libraries against a real server: a LangGraph graph
whose model calls a tool that actually runs, then answers from its result; and the openai SDK's Responses stream
helper up to its final response."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import openai
import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from typing_extensions import TypedDict

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import served_engine

MODEL = "smol"
CALLS: list[str] = []  # the cities the tool was run for


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLS.append(city)
    return f"It is sunny and 21 degrees in {city}."


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(EngineConfig(num_kv_blocks=256), smol_loaded, ServerSettings([MODEL])) as url:
        yield url


def weather_agent(llm: ChatOpenAI):  # type: ignore[no-untyped-def]  # langgraph's compiled graph type is generic
    """The model must call the tool on its first turn (a named tool_choice: a small model would not by itself),
    then answers from the tool's result with the tools still shown but not forced."""
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    free = llm.bind_tools([get_weather], tool_choice="none")

    def model(state: AgentState) -> dict:
        called = any(isinstance(message, ToolMessage) for message in state["messages"])
        return {"messages": [(free if called else forced).invoke(state["messages"])]}

    def next_step(state: AgentState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(AgentState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", next_step, ["tools", END])
    graph.add_edge("tools", "model")
    return graph.compile()


def test_langgraph_agent_calls_a_tool_and_answers_from_it(url: str) -> None:
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60, max_retries=0)
    CALLS.clear()
    result = weather_agent(llm).invoke({"messages": [HumanMessage("What is the weather in Paris?")]})
    kinds = [type(message).__name__ for message in result["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call = result["messages"][1].tool_calls[0]
    assert call["name"] == "get_weather" and [call["args"]["city"]] == CALLS
    assert result["messages"][2].tool_call_id == call["id"]
    answer = result["messages"][3]
    assert not answer.tool_calls and answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")


def test_responses_stream_get_final_response(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    # A response cut by max_output_tokens ends with response.incomplete, which the helper does not take for an end
    # (with OpenAI's servers alike): the answer here is short and complete.
    # Both answers compared below find the prompt's blocks cached: a prompt computed whole and one computed after
    # a cached prefix round differently (~1e-4 in a logprob), which can part greedy answers at a near-tie.
    client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=1, temperature=0)
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) != ""
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0)
    assert whole.output_text == final.output_text
