// The official OpenAI JS SDK, unmodified, against a running mlx-engined front-end.
//
// Run by tests/test_js_sdk.py: `node sdk_checks.mjs` with MLXE_BASE_URL (the front-end's /v1 URL)
// and MLXE_MODEL (a model id it serves). Each check records what the SDK returned as plain JSON;
// the Python test asserts on it, so one failing check does not hide the others. A check that
// throws is recorded as {"error": ...}. The model has random weights: determinism comes from
// greedy decoding (temperature 0), ignore_eos + max_tokens, and constrained decoding.

import OpenAI from 'openai';

const baseURL = process.env.MLXE_BASE_URL;
const model = process.env.MLXE_MODEL;
if (!baseURL || !model) {
  console.error('MLXE_BASE_URL and MLXE_MODEL must be set');
  process.exit(2);
}

const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
const messages = [{ role: 'user', content: 'Tell me a story.' }];

// Bounded strings and no extra properties: the random-weight model otherwise rambles to max_tokens.
const WEATHER_TOOL = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather in a city',
    strict: true,
    parameters: {
      type: 'object',
      properties: {
        city: { type: 'string', maxLength: 16 },
        unit: { type: 'string', enum: ['C', 'F'] },
      },
      required: ['city', 'unit'],
      additionalProperties: false,
    },
  },
};

const THING_SCHEMA = {
  type: 'object',
  properties: {
    color: { type: 'string', enum: ['red', 'green', 'blue'] },
    count: { type: 'integer', minimum: 1, maximum: 99 },
    nick: { type: 'string', pattern: '^[a-z]{1,6}$' },
  },
  required: ['color', 'count', 'nick'],
  additionalProperties: false,
};

const checks = {
  /** Non-streaming chat, then the same request streamed with usage: same text, same usage. */
  async chat() {
    const request = { model, messages, temperature: 0, max_tokens: 12, ignore_eos: true };
    const result = await client.chat.completions.create(request);
    const stream = await client.chat.completions.create({
      ...request, stream: true, stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    const withChoices = chunks.filter((c) => c.choices.length > 0);
    const last = chunks[chunks.length - 1];
    return {
      id: result.id,
      object: result.object,
      text: result.choices[0].message.content,
      role: result.choices[0].message.role,
      finish_reason: result.choices[0].finish_reason,
      usage: result.usage,
      stream_objects: [...new Set(chunks.map((c) => c.object))],
      stream_ids: [...new Set(chunks.map((c) => c.id))].length,
      stream_first_role: withChoices[0]?.choices[0].delta.role ?? null,
      stream_text: withChoices.map((c) => c.choices[0].delta.content ?? '').join(''),
      stream_finish_reasons: withChoices.map((c) => c.choices[0].finish_reason).filter(Boolean),
      stream_usage_only_on_last: chunks.slice(0, -1).every((c) => !c.usage),
      stream_last_choices: last.choices.length,
      stream_last_usage: last.usage ?? null,
    };
  },

  /** The SDK's stream helper assembles chunks into a final completion. */
  async chat_stream_helper() {
    const runner = client.chat.completions.stream({
      model, messages, temperature: 0, max_tokens: 12, ignore_eos: true,
    });
    const deltas = [];
    runner.on('content', (delta) => deltas.push(delta));
    const final = await runner.finalChatCompletion();
    return { deltas: deltas.join(''), final_text: final.choices[0].message.content,
             finish_reason: final.choices[0].finish_reason };
  },

  /** tool_choice "required": a call the SDK parses (strict tool → parsed_arguments), and streamed. */
  async tool_call() {
    const request = {
      model, temperature: 0, max_tokens: 120, tools: [WEATHER_TOOL], tool_choice: 'required',
      parallel_tool_calls: false, messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
    };
    const parsed = await client.chat.completions.parse(request);
    const choice = parsed.choices[0];
    const runner = client.chat.completions.stream(request);
    const streamedArgs = [];
    runner.on('tool_calls.function.arguments.done', (event) => streamedArgs.push(event.parsed_arguments));
    const final = await runner.finalChatCompletion();
    const finalChoice = final.choices[0];
    return {
      finish_reason: choice.finish_reason,
      content: choice.message.content ?? null,
      calls: (choice.message.tool_calls ?? []).map((call) => ({
        id: call.id, type: call.type, name: call.function.name, arguments: call.function.arguments,
        parsed_arguments: call.function.parsed_arguments,
      })),
      stream_finish_reason: finalChoice.finish_reason,
      stream_calls: (finalChoice.message.tool_calls ?? []).map((call) => ({
        name: call.function.name, arguments: call.function.arguments,
        parsed_arguments: call.function.parsed_arguments,
      })),
      stream_parsed_arguments: streamedArgs,
    };
  },

  /** response_format json_schema through chat.completions.parse: message.parsed is the object. */
  async json_schema() {
    const result = await client.chat.completions.parse({
      model, temperature: 0, max_tokens: 200,
      messages: [{ role: 'user', content: 'Describe a thing.' }],
      response_format: { type: 'json_schema', json_schema: { name: 'thing', schema: THING_SCHEMA, strict: true } },
    });
    const message = result.choices[0].message;
    return { finish_reason: result.choices[0].finish_reason, content: message.content, parsed: message.parsed,
             schema: THING_SCHEMA };
  },

  /** Responses API: non-streaming, streamed with `for await`, and the stream helper's final response. */
  async responses() {
    const request = { model, input: 'Tell me a story.', max_output_tokens: 8, temperature: 0, ignore_eos: true };
    const result = await client.responses.create(request);
    const stream = await client.responses.create({ ...request, stream: true });
    const events = [];
    for await (const event of stream) events.push(event);
    const helper = client.responses.stream(request);
    const helperDeltas = [];
    helper.on('response.output_text.delta', (event) => helperDeltas.push(event.delta));
    const final = await helper.finalResponse();
    const done = events[events.length - 1];
    return {
      id: result.id,
      object: result.object,
      status: result.status,
      incomplete_reason: result.incomplete_details?.reason ?? null,
      output_text: result.output_text,
      output_types: result.output.map((item) => item.type),
      usage: result.usage,
      event_types: events.map((event) => event.type),
      sequence_numbers: events.map((event) => event.sequence_number),
      stream_text: events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join(''),
      stream_final_status: done.response?.status ?? null,
      // Raw events carry the API's response object; output_text is an SDK convenience it lacks.
      stream_final_text: (done.response?.output ?? []).flatMap((item) => item.content ?? [])
        .filter((part) => part.type === 'output_text').map((part) => part.text).join(''),
      stream_final_usage: done.response?.usage ?? null,
      helper_text: helperDeltas.join(''),
      helper_final_text: final.output_text,
      helper_final_status: final.status,
    };
  },

  /** A bad parameter: the SDK throws BadRequestError carrying the error's status, type, param, code. */
  async bad_request() {
    const caught = [];
    const attempts = [
      () => client.chat.completions.create({ model, messages, temperature: 5 }),
      () => client.responses.create({ model, input: 'hi', max_output_tokens: 0 }),
    ];
    for (const attempt of attempts) {
      try {
        await attempt();
        caught.push({ thrown: false });
      } catch (err) {
        caught.push({
          thrown: true,
          class: err.constructor.name,
          is_bad_request: err instanceof OpenAI.BadRequestError,
          is_api_error: err instanceof OpenAI.APIError,
          status: err.status ?? null,
          type: err.type ?? null,
          param: err.param ?? null,
          code: err.code ?? null,
          message: err.message,
        });
      }
    }
    return { caught };
  },
};

const results = {};
for (const [name, check] of Object.entries(checks)) {
  const started = performance.now();
  try {
    results[name] = await check();
  } catch (err) {
    results[name] = { error: `${err?.constructor?.name}: ${err?.message}\n${err?.stack ?? ''}` };
  }
  results[name].ms = Math.round(performance.now() - started);
}
process.stdout.write(`${JSON.stringify(results)}\n`);
