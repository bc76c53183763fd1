//! Tokenizer (HF `tokenizers`) and chat template (Jinja via `minijinja`, rendered from the model's own
//! `tokenizer_config.json`).

use std::collections::HashMap;
use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as JValue};
use serde_json::{json, Value};

use crate::schema::Message;
use crate::{Error, Result};

fn tok_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("tokenizer {what}: {e}"))
}

/// GPT-2's byte ↔ printable-character table (`bytes_to_unicode` in OpenAI's `encoder.py`): bytes
/// `!`..`~`, `¡`..`¬`, `®`..`ÿ` map to themselves, the other 68 bytes to U+0100 onwards in order.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut keep: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    keep.extend(0xA1..=0xAC);
    keep.extend(0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut extra = 0u32;
    for b in 0u32..256 {
        let c = if keep.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let Some(ch) = char::from_u32(c) {
            map.insert(ch, b as u8);
        }
    }
    map
}

/// The model's tokenizer with its special tokens.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    byte_decoder: HashMap<char, u8>,
    /// Whether the tokenizer is byte-level BPE (token strings spell bytes with GPT-2's table).
    byte_level: bool,
    /// Ids of tokens marked `special` (skipped when decoding for display).
    special_ids: std::collections::HashSet<u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer").field("vocab", &self.vocab_size()).field("byte_level", &self.byte_level).finish()
    }
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    ///
    /// # Errors
    /// [`Error::Model`] when the file is missing or not a valid tokenizer.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer> {
        let p = dir.join("tokenizer.json");
        let bytes = std::fs::read(&p).map_err(|e| Error::io("read", &p, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tok_err("load", e))?;
        let v: Value = serde_json::from_slice(&bytes)?;
        let byte_level = v.pointer("/decoder/type").and_then(|t| t.as_str()) == Some("ByteLevel");
        let special_ids = inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        Ok(TextTokenizer { inner, byte_decoder: byte_level_decoder(), byte_level, special_ids })
    }

    /// [`TextTokenizer::from_dir`], shared: while one is alive, every load of this process from the same
    /// `tokenizer.json` (path, length, modification time) gets the same tokenizer instead of another copy
    /// (about 13 MiB for SmolLM2's 49k-token BPE; the policy server holds one model per resident tenant
    /// adapter). Loads are serialised, so concurrent loaders parse the file once.
    ///
    /// # Errors
    /// As [`TextTokenizer::from_dir`]; [`Error::Io`] when the file's metadata cannot be read.
    pub fn shared_from_dir(dir: &Path) -> Result<std::sync::Arc<TextTokenizer>> {
        type Key = (std::path::PathBuf, u64, Option<std::time::SystemTime>);
        static SHARED: std::sync::LazyLock<std::sync::Mutex<HashMap<Key, std::sync::Weak<TextTokenizer>>>> = std::sync::LazyLock::new(Default::default);
        let p = dir.join("tokenizer.json");
        let meta = std::fs::metadata(&p).map_err(|e| Error::io("stat", &p, e))?;
        let key = (std::fs::canonicalize(&p).unwrap_or(p), meta.len(), meta.modified().ok());
        let mut map = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(t) = map.get(&key).and_then(std::sync::Weak::upgrade) {
            return Ok(t);
        }
        let t = std::sync::Arc::new(TextTokenizer::from_dir(dir)?);
        map.insert(key, std::sync::Arc::downgrade(&t));
        Ok(t)
    }

    /// Token ids of `text`; no BOS/EOS is added (the chat template writes what the model needs).
    /// Special-token strings in the text (e.g. `<|im_start|>`) become their ids.
    ///
    /// # Errors
    /// [`Error::Model`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode_fast(text, false).map_err(|e| tok_err("encode", e))?.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are dropped when `skip_special`.
    ///
    /// # Errors
    /// [`Error::Model`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size()) {
            return Err(Error::Model(format!("token id {bad} is outside the vocabulary of {} tokens", self.vocab_size())));
        }
        self.inner.decode(ids, skip_special).map_err(|e| tok_err("decode", e))
    }

    /// The token's string as stored in the vocabulary (`Ġthe` for " the" in byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is a special token (skipped in displayed text).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// The raw bytes a token stands for (byte-level BPE: its characters mapped back through GPT-2's
    /// table; added tokens and other tokenizers: the UTF-8 of its decoded text). Empty for unknown ids.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(tok) = self.inner.id_to_token(id) else { return vec![] };
        if self.byte_level && !self.inner.get_added_tokens_decoder().contains_key(&id) {
            let bytes: Option<Vec<u8>> = tok.chars().map(|c| self.byte_decoder.get(&c).copied()).collect();
            if let Some(b) = bytes {
                return b;
            }
        }
        if self.inner.get_added_tokens_decoder().contains_key(&id) {
            return tok.into_bytes();
        }
        self.inner.decode(&[id], false).map(|s| s.into_bytes()).unwrap_or_default()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)` (what HF's `tojson` filter calls):
/// separators `", "` and `": "` without indent, `","` and `": "` with it.
fn python_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let nl = |out: &mut String, lvl: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * lvl));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                nl(out, level + 1);
                python_json(x, indent, level + 1, out);
            }
            nl(out, level);
            out.push(']');
        }
        Value::Object(m) if !m.is_empty() => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                nl(out, level + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(x, indent, level + 1, out);
            }
            nl(out, level);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            // Python prints floats with at least one decimal (1.0), serde_json too; keep serde's.
            out.push_str(&n.to_string());
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A chat template from `tokenizer_config.json`, rendered like HF `apply_chat_template`
/// (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`, Python-style `tojson`,
/// Python string/dict methods via minijinja-contrib's pycompat).
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The special-token strings the template may use (`bos_token`, `eos_token`, ...).
    tokens: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("tokens", &self.tokens).finish()
    }
}

/// The token string of a `tokenizer_config.json` entry (a string or `{"content": ...}`).
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// Builds a template from its Jinja source and special-token strings.
    ///
    /// # Errors
    /// [`Error::Model`] for a template syntax error.
    pub fn new(source: &str, tokens: serde_json::Map<String, Value>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<JValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("chat template raised: {msg}")))
        });
        env.add_function("strftime_now", |fmt: String| -> std::result::Result<String, minijinja::Error> {
            use std::fmt::Write;
            let mut s = String::new();
            write!(s, "{}", chrono::Local::now().format(&fmt))
                .map_err(|_| minijinja::Error::new(ErrorKind::InvalidOperation, format!("invalid strftime format {fmt:?}")))?;
            Ok(s)
        });
        env.add_filter("tojson", |v: JValue, kwargs: minijinja::value::Kwargs| -> std::result::Result<String, minijinja::Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            let _: Option<JValue> = kwargs.get("ensure_ascii")?;
            let _: Option<JValue> = kwargs.get("sort_keys")?;
            kwargs.assert_all_used()?;
            let json: Value = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let mut out = String::new();
            python_json(&json, indent, 0, &mut out);
            Ok(out)
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| Error::Model(format!("chat template: {e:#}")))?;
        Ok(ChatTemplate { env, tokens })
    }

    /// Loads `chat_template` and the special tokens from `dir/tokenizer_config.json`; `Ok(None)` when
    /// the model has no template. A `chat_template.jinja` file, when present, takes precedence (newer
    /// HF checkpoints store it there). A list of named templates uses the one named `default`.
    ///
    /// # Errors
    /// [`Error::Json`] for a malformed config; [`Error::Model`] for a template syntax error.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let p = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&p) {
            Ok(s) => serde_json::from_str(&s)?,
            Err(_) => json!({}),
        };
        let mut tokens = serde_json::Map::new();
        for k in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = token_string(cfg.get(k)) {
                tokens.insert(k.to_string(), Value::String(s));
            }
        }
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io("read", &jinja, e))?)
        } else {
            match cfg.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                _ => None,
            }
        };
        source.map(|s| ChatTemplate::new(&s, tokens)).transpose()
    }

    /// The HF-format JSON of a message: `{role, content, tool_calls?: [{id?, type: "function",
    /// function: {name, arguments}}], tool_call_id?, name?, reasoning_content?}`. Arguments are the
    /// parsed JSON object when there is one (templates apply `tojson` to it), else the raw string.
    pub fn message_json(m: &Message) -> Value {
        let mut o = serde_json::Map::new();
        o.insert("role".into(), json!(m.role));
        o.insert("content".into(), json!(m.content));
        if !m.tool_calls.is_empty() {
            let calls: Vec<Value> = m
                .tool_calls
                .iter()
                .map(|c| {
                    let args = if c.arguments.is_null() { json!(c.arguments_raw.clone().unwrap_or_default()) } else { c.arguments.clone() };
                    let mut call = json!({"type": "function", "function": {"name": c.name, "arguments": args}});
                    if let (Some(id), Some(obj)) = (&c.id, call.as_object_mut()) {
                        obj.insert("id".into(), json!(id));
                    }
                    call
                })
                .collect();
            o.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &m.tool_call_id {
            o.insert("tool_call_id".into(), json!(id));
        }
        if let Some(n) = &m.name {
            o.insert("name".into(), json!(n));
        }
        if let Some(r) = &m.reasoning {
            o.insert("reasoning_content".into(), json!(r));
        }
        Value::Object(o)
    }

    /// Renders the conversation. `tools` (a JSON array of OpenAI tool definitions) is passed through
    /// as the template variable `tools`; `extra` adds template variables (e.g. `enable_thinking`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the template raises (`raise_exception`) or fails on these messages.
    pub fn render(&self, messages: &[Message], tools: Option<&Value>, add_generation_prompt: bool, extra: Option<&serde_json::Map<String, Value>>) -> Result<String> {
        let mut ctx = self.tokens.clone();
        ctx.insert("messages".into(), Value::Array(messages.iter().map(Self::message_json).collect()));
        ctx.insert("add_generation_prompt".into(), json!(add_generation_prompt));
        if let Some(t) = tools {
            ctx.insert("tools".into(), t.clone());
        }
        if let Some(e) = extra {
            for (k, v) in e {
                ctx.insert(k.clone(), v.clone());
            }
        }
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Internal(format!("chat template: {e}")))?;
        tmpl.render(JValue::from_serialize(Value::Object(ctx))).map_err(|e| Error::InvalidInput(format!("chat template: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system() {
        let t = ChatTemplate::new(CHATML, Default::default()).unwrap();
        let s = t.render(&[Message::text("user", "Hi")], None, true, None).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let s = t.render(&[Message::text("system", "S"), Message::text("user", "Q")], None, false, None).unwrap();
        assert_eq!(s, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n");
    }

    #[test]
    fn python_features_tools_and_raise() {
        let src = "{% if messages[0].role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\
            {{ messages[0].content.strip().upper() }}|{{ tools[0] | tojson }}|{{ bos_token }}|{{ strftime_now('%Y') | length }}\
            {% for m in messages %}{% for c in m.tool_calls %}|{{ c.function.name }}:{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
        let mut tokens = serde_json::Map::new();
        tokens.insert("bos_token".into(), json!("<s>"));
        let t = ChatTemplate::new(src, tokens).unwrap();
        let mut m = Message::text("user", "  hello ");
        m.tool_calls.push(crate::schema::ToolCall { id: Some("c1".into()), name: "f".into(), arguments: json!({"a": 1, "b": [1, 2]}), arguments_raw: None });
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let s = t.render(&[m], Some(&tools), true, None).unwrap();
        assert_eq!(s, r#"HELLO|{"function": {"name": "f"}, "type": "function"}|<s>|4|f:{"a": 1, "b": [1, 2]}"#);
        let e = t.render(&[Message::text("bad", "x")], None, true, None).unwrap_err().to_string();
        assert!(e.contains("no bad roles"), "{e}");
    }

    /// Qwen2.5's template (tools, tool calls, tool responses) rendered by HF transformers 5.24
    /// `apply_chat_template` (Jinja2) is reproduced byte for byte.
    #[test]
    fn qwen25_tool_template_matches_transformers() {
        let src = include_str!("../../tests/data/chat_templates/qwen2.5.jinja");
        let want = include_str!("../../tests/data/chat_templates/qwen2.5_tools.expected");
        let t = ChatTemplate::new(src, Default::default()).unwrap();
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]);
        let mut call = Message::text("assistant", "");
        call.tool_calls.push(crate::schema::ToolCall { id: None, name: "get_weather".into(), arguments: json!({"city": "Paris", "unit": "c"}), arguments_raw: None });
        let messages = vec![
            Message::text("user", "What's the weather in Paris?"),
            call,
            Message::text("tool", "{\"temp\": 21}"),
            Message::text("assistant", "It is 21 °C in Paris."),
            Message::text("user", "Thanks!"),
        ];
        assert_eq!(t.render(&messages, Some(&tools), true, None).unwrap(), want);
        let plain = include_str!("../../tests/data/chat_templates/qwen2.5_plain.expected");
        assert_eq!(t.render(&messages[..1], None, true, None).unwrap(), plain);
    }

    #[test]
    fn tojson_indent_matches_python() {
        let mut out = String::new();
        python_json(&json!({"a": [1, {"b": "x"}], "c": {}}), Some(2), 0, &mut out);
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"x\"\n    }\n  ],\n  \"c\": {}\n}");
    }

    #[test]
    fn gpt2_byte_table() {
        let d = byte_level_decoder();
        assert_eq!(d.len(), 256);
        assert_eq!(d[&'Ġ'], b' ');
        assert_eq!(d[&'Ċ'], b'\n');
        assert_eq!(d[&'a'], b'a');
    }
}
