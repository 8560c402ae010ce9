// The Node clients of the client matrix: one case per run, as an app would call the gateway.
// Usage: node cases.mjs CASE BASE_URL MODEL  (BASE_URL ends in /v1). Prints one JSON object on stdout; exits
// non-zero with the error on stderr when a client call fails unexpectedly.
import OpenAI from "openai";
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, generateText, jsonSchema, stepCountIs, tool } from "ai";

const [caseName, baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "sk-matrix", maxRetries: 0 });
const provider = createOpenAI({ baseURL, apiKey: "sk-matrix" });

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
const question = (text) => [{ role: "user", content: text }];

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
      model, messages, tools: [weatherTool], max_tokens: 64,
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

  // AI SDK 6, `.chat(...)`: a two-step tool loop (the SDK sends the arguments back re-serialised).
  async "ai-sdk tool loop"(prompt, forced) {
    const result = await generateText({
      model: provider.chat(model),
      prompt,
      maxOutputTokens: 64,
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

  // AI SDK 6, `.chat(...)`: `generateObject` (a JSON-schema response format).
  async "ai-sdk generateObject"(prompt) {
    const result = await generateObject({
      model: provider.chat(model),
      prompt,
      maxOutputTokens: 64,
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
