"""The Responses API (`/v1/responses`), served by translating each create into a chat completion.

`request` turns a create into the chat-completions request an engine serves, `output` builds the `Response`
and its stream events from the chat reply, `store` keeps stored responses (recent ones in memory, all in SQL),
and `service` ties them to `ChatService` so a Responses call is captured like chat traffic.
"""
