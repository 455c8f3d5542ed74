//! Where a user's server answers and how migprof reaches it: the base URL, the headers every request
//! carries, and the HTTP agent of one client connection.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// A server's address and what every request to it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// The base URL without a trailing slash: `http://127.0.0.1:8000`.
    pub url: String,
    /// Headers every request carries (an API key, a tenant), as `Name: value`.
    pub headers: Vec<(String, String)>,
    /// A request not answered within this long is a failed request.
    pub request_timeout: Duration,
}

/// An answer as read off the wire: status, headers that matter, body, and when the last byte came.
pub struct Answer {
    pub status: u16,
    /// The value of `Inference-Header-Content-Length` (KServe's binary extension), if any.
    pub inference_header_length: Option<usize>,
    pub body: Vec<u8>,
    pub read_at: Instant,
}

/// A request that got no answer to check: the connection failed, timed out, or the body broke off.
#[derive(Debug, Clone, PartialEq)]
pub struct Unanswered(pub String);

/// A header given as `Name: value`, checked.
pub fn header(h: &str) -> Result<(String, String)> {
    match h.split_once(':') {
        Some((name, value)) if !name.trim().is_empty() && name.trim().bytes().all(is_token) => {
            Ok((name.trim().to_string(), value.trim().to_string()))
        }
        _ => bail!("{h:?}: give it as `Name: value`, e.g. `Authorization: Bearer $KEY`"),
    }
}

/// The most bytes an answer may have: a larger one is a broken server, not a result.
const MAX_ANSWER_BYTES: u64 = 1 << 30;

impl Endpoint {
    /// The endpoint of `url` (`http://` or `https://`, a host, perhaps a port and a path prefix),
    /// with the headers given as `Name: value`.
    pub fn new(url: &str, headers: &[String], request_timeout: Duration) -> Result<Endpoint> {
        let url = url.trim();
        let Some(rest) = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://")) else {
            bail!("{url}: give the server's base URL with its scheme, e.g. http://127.0.0.1:8000");
        };
        let url = url.trim_end_matches('/');
        if rest.is_empty() || rest.starts_with('/') || rest.starts_with(':') {
            bail!("{url}: no host; e.g. http://127.0.0.1:8000");
        }
        let headers = headers.iter().map(|h| header(h)).collect::<Result<Vec<_>>>()?;
        Ok(Endpoint {
            url: url.to_string(),
            headers,
            request_timeout,
        })
    }

    /// Whether something accepts connections at its host and port now (a second from now at most).
    pub fn listening(&self) -> bool {
        let rest = self.url.split_once("://").map_or(self.url.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or_default();
        let with_port = match (authority.rsplit_once(':'), self.url.starts_with("https://")) {
            (Some((_, port)), _) if port.bytes().all(|b| b.is_ascii_digit()) && !port.is_empty() => {
                authority.to_string()
            }
            (_, true) => format!("{authority}:443"),
            (_, false) => format!("{authority}:80"),
        };
        use std::net::ToSocketAddrs;
        with_port.to_socket_addrs().is_ok_and(|mut addresses| {
            addresses.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
        })
    }

    /// A client of its own connection (kept alive between its requests, as perf_analyzer's
    /// workers keep theirs): 4xx and 5xx are answers to read, not errors.
    pub fn agent(&self) -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(self.request_timeout))
            .max_idle_connections(4)
            .max_idle_connections_per_host(4)
            .user_agent(format!("migprof/{}", crate::provenance::VERSION))
            .build()
            .into()
    }

    /// GETs `path` (from the base URL).
    pub fn get(&self, agent: &ureq::Agent, path: &str) -> Result<Answer, Unanswered> {
        let mut request = agent.get(format!("{}{path}", self.url));
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        read(request.call())
    }

    /// POSTs `body` to `path` with `headers` besides the endpoint's own, its answer's body left to
    /// be read as it comes (a stream of server-sent events): the status, and a reader of the body.
    pub fn post_streaming(
        &self,
        agent: &ureq::Agent,
        path: &str,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<(u16, ureq::BodyReader<'static>), Unanswered> {
        let mut request = agent.post(format!("{}{path}", self.url));
        for (name, value) in self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v))
            .chain(headers.iter().map(|(n, v)| (*n, v)))
        {
            request = request.header(name, value);
        }
        let response = request.send(body).map_err(|e| Unanswered(e.to_string()))?;
        let status = response.status().as_u16();
        Ok((
            status,
            response.into_body().into_with_config().limit(MAX_ANSWER_BYTES).reader(),
        ))
    }

    /// POSTs `body` to `path` with `headers` besides the endpoint's own.
    pub fn post(
        &self,
        agent: &ureq::Agent,
        path: &str,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<Answer, Unanswered> {
        let mut request = agent.post(format!("{}{path}", self.url));
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        read(request.send(body))
    }
}

fn read(sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<Answer, Unanswered> {
    let mut response = sent.map_err(|e| Unanswered(e.to_string()))?;
    let status = response.status().as_u16();
    let inference_header_length = response
        .headers()
        .get("inference-header-content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let body = response
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER_BYTES)
        .read_to_vec()
        .map_err(|e| Unanswered(format!("reading the answer: {e}")))?;
    Ok(Answer {
        status,
        inference_header_length,
        body,
        read_at: Instant::now(),
    })
}

/// A byte of an HTTP header's name (RFC 9110's token).
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

impl Answer {
    /// The body as text, cut to `n` characters: what a server said when it refused.
    pub fn text(&self, n: usize) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let text = text.trim();
        match text.char_indices().nth(n) {
            Some((i, _)) => format!("{}…", &text[..i]),
            None => text.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_headers_are_checked_naming_what_to_give() {
        let t = Duration::from_secs(1);
        let e = Endpoint::new("http://127.0.0.1:8000/", &["Authorization: Bearer k".into()], t).unwrap();
        assert_eq!(e.url, "http://127.0.0.1:8000");
        assert_eq!(e.headers, vec![("Authorization".to_string(), "Bearer k".to_string())]);
        let err = |url: &str, headers: &[String]| Endpoint::new(url, headers, t).unwrap_err().to_string();
        assert!(err("127.0.0.1:8000", &[]).contains("with its scheme"));
        assert!(err("http://", &[]).contains("no host"));
        assert!(err("http://h", &["novalue".into()]).contains("`Name: value`"));
        assert!(err("http://h", &["a b: c".into()]).contains("`Name: value`"));
    }

    #[test]
    fn something_listening_is_seen_and_nothing_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let at = |url: &str| Endpoint::new(url, &[], Duration::from_secs(1)).unwrap();
        assert!(at(&format!("http://127.0.0.1:{port}")).listening());
        assert!(at(&format!("http://127.0.0.1:{port}/prefix/")).listening());
        drop(listener);
        assert!(!at(&format!("http://127.0.0.1:{port}")).listening());
    }
}
