// The Node clients of the client matrix: one case per run, as an app would call the gateway.
// Usage: node cases.mjs CASE BASE_URL MODEL  (BASE_URL ends in /v1). Prints one JSON object on stdout; exits
// non-zero with the error on stderr when a client call fails unexpectedly. MATRIX_API picks the AI SDK's model:
// `chat` is `provider.chat(model)`, `responses` the provider's default, `provider(model)` (the Responses API).
// MATRIX_JSON_TEMPERATURE is the temperature of the calls whose reply must be a whole JSON object (a forced tool
// call, a generated object): 0 on the small embedded model, which now and then overruns the token budget when
// sampled; empty leaves the client's default.
import OpenAI from "openai";
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const [caseName, baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "sk-matrix", maxRetries: 0 });
const provider = createOpenAI({ baseURL, apiKey: "sk-matrix" });
const languageModel = process.env.MATRIX_API === "responses" ? provider(model) : provider.chat(model);

const weatherParameters = {
  type: "object",
  properties: { city: { type: "string" } },
  required: ["city"],
  additionalProperties: false,
};
const weatherTool = {
  type: "function",
  function: { name: "get_weather", description: "Current weather in a city", parameters: weatherParameters },
};
const responsesWeatherTool = {
  type: "function", name: "get_weather", description: "Current weather in a city",
  parameters: weatherParameters, strict: true,
};
const question = (text) => [{ role: "user", content: text }];
const jsonTemperature = process.env.MATRIX_JSON_TEMPERATURE
  ? Number(process.env.MATRIX_JSON_TEMPERATURE) : undefined;

const cases = {
  // openai-node: a streamed reply, assembled from its chunks.
  async "openai-node stream"(prompt) {
    const stream = await client.chat.completions.create({
      model, messages: question(prompt), stream: true, max_tokens: 24,
      stream_options: { include_usage: true },
    });
    let text = "";
    let usage = null;
    let finish = null;
    for await (const chunk of stream) {
      for (const choice of chunk.choices) {
        text += choice.delta.content ?? "";
        finish = choice.finish_reason ?? finish;
      }
      usage = chunk.usage ?? usage;
    }
    return { text, finish, completionTokens: usage?.completion_tokens ?? null };
  },

  // openai-node: a forced tool call, answered with the tool's result in a second call.
  async "openai-node tools"(prompt) {
    const messages = question(prompt);
    const first = await client.chat.completions.create({
      model, messages, tools: [weatherTool], max_tokens: 64, temperature: jsonTemperature,
      tool_choice: { type: "function", function: { name: "get_weather" } },
    });
    const message = first.choices[0].message;
    const calls = message.tool_calls ?? [];
    messages.push(message);
    for (const call of calls) {
      messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify({ sky: "sunny" }) });
    }
    const second = await client.chat.completions.create({ model, messages, max_tokens: 24 });
    return {
      calls: calls.map((c) => ({ name: c.function.name, arguments: JSON.parse(c.function.arguments) })),
      text: second.choices[0].message.content,
    };
  },

  // openai-node: the typed errors an app catches.
  async "openai-node errors"() {
    const caught = {};
    for (const [name, body] of [
      ["unknown model", { model: "no-such-model", messages: question("hi") }],
      ["bad request", { model, messages: [] }],
    ]) {
      try {
        await client.chat.completions.create(body);
        caught[name] = null;
      } catch (error) {
        caught[name] = {
          cls: error.constructor.name, status: error.status, type: error.type, code: error.code, param: error.param,
        };
      }
    }
    return caught;
  },

  // openai-node, `client.responses`: a streamed response through the SDK's stream helper.
  async "openai-node responses stream"(prompt) {
    let text = "";
    const stream = client.responses.stream({ model, input: prompt, max_output_tokens: 24 });
    stream.on("response.output_text.delta", (event) => { text += event.delta; });
    const final = await stream.finalResponse();
    return {
      text, outputText: final.output_text, status: final.status, outputTokens: final.usage?.output_tokens ?? null,
    };
  },

  // openai-node, `client.responses`: a function call, answered by sending the whole input back with the
  // response's output items and the tool's output (no stored state used).
  async "openai-node responses tool"(prompt, forced) {
    const input = question(prompt);
    const first = await client.responses.create({
      model, input, tools: [responsesWeatherTool], max_output_tokens: 64, temperature: jsonTemperature,
      tool_choice: forced ? { type: "function", name: "get_weather" } : "auto",
    });
    const calls = first.output.filter((item) => item.type === "function_call");
    input.push(...first.output);
    for (const call of calls) {
      input.push({ type: "function_call_output", call_id: call.call_id, output: JSON.stringify({ sky: "sunny" }) });
    }
    const second = await client.responses.create({ model, input, max_output_tokens: 24 });
    return {
      calls: calls.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) })),
      text: second.output_text,
    };
  },

  // AI SDK 6: a two-step tool loop (the SDK sends the arguments back re-serialised; with the Responses
  // provider it sends the whole input back each step).
  async "ai-sdk tool loop"(prompt, forced) {
    const result = await generateText({
      model: languageModel,
      prompt,
      maxOutputTokens: 64,
      temperature: jsonTemperature,
      tools: {
        get_weather: tool({
          description: "Current weather in a city",
          inputSchema: jsonSchema(weatherParameters),
          execute: async ({ city }) => ({ city, sky: "sunny" }),
        }),
      },
      // On the small embedded model the first step is forced (it would not pick a tool on its own), the
      // second left to answer in text.
      prepareStep: forced ? ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }) : undefined,
      stopWhen: stepCountIs(2),
    });
    return {
      steps: result.steps.length,
      calls: result.steps.flatMap((s) => s.toolCalls.map((c) => ({ name: c.toolName, arguments: c.input }))),
      text: result.text,
    };
  },

  // AI SDK 6: `streamText`, the text assembled from its stream.
  async "ai-sdk streamText"(prompt) {
    const result = streamText({ model: languageModel, prompt, maxOutputTokens: 24 });
    let text = "";
    for await (const delta of result.textStream) text += delta;
    return { text, finish: await result.finishReason, outputTokens: (await result.usage).outputTokens ?? null };
  },

  // AI SDK 6: `generateObject` (a JSON-schema response format, or `text.format` with the Responses API).
  async "ai-sdk generateObject"(prompt) {
    const result = await generateObject({
      model: languageModel,
      prompt,
      maxOutputTokens: 64,
      temperature: jsonTemperature,
      schema: jsonSchema({
        type: "object",
        properties: { city: { type: "string" }, sunny: { type: "boolean" } },
        required: ["city", "sunny"],
        additionalProperties: false,
      }),
    });
    return { object: result.object };
  },
};

const run = cases[caseName];
if (run === undefined) {
  console.error(`unknown case ${caseName}; known: ${Object.keys(cases).join(", ")}`);
  process.exit(2);
}
const prompt = process.env.MATRIX_PROMPT ?? "What is the weather in Paris?";
const forced = process.env.MATRIX_FORCED === "1";
console.log(JSON.stringify(await run(prompt, forced)));
