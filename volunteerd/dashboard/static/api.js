// Talking to the daemon's control API (/api/v1): the token, one call, the two errors.
//
// The token arrives in the address's fragment (#token=…, from `volunteerd dashboard`; a
// fragment is never sent to a server), is kept in sessionStorage for this tab only, and
// is taken out of the address bar at once, so it stays out of history and bookmarks.

const PREFIX = "/api/v1";
const TOKEN_KEY = "volunteerd.token";
const TIMEOUT_MS = 10000;

/** The daemon answered with an error: ``status``, its ``message`` and the bad ``field``. */
export class ApiError extends Error {
  constructor(status, message, field) {
    super(message);
    this.status = status;
    this.field = field ?? null;
  }
}

/** No answer: the daemon is not running, or hangs. */
export class Unreachable extends Error {}

/** The token from the fragment (then remembered) or from earlier in this tab; or null. */
export function takeToken() {
  const fragment = new URLSearchParams(location.hash.slice(1));
  const given = fragment.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
    fragment.delete("token");
    const rest = fragment.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

/** A function ``call(method, path, body, {timeoutMs, signal})`` that returns the reply's
 * JSON, or throws ApiError or Unreachable. It tells ``on.answered()`` about every answer,
 * ``on.lost()`` about every failure to get one, and ``on.refused()`` about a 401.
 * A call cancelled through ``signal`` throws the AbortError and tells nobody. */
export function connect(token, on) {
  return async function call(method, path, body, { timeoutMs = TIMEOUT_MS, signal } = {}) {
    const timeout = AbortSignal.timeout(timeoutMs);
    const headers = { Authorization: `Bearer ${token}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    let data = null;
    try {
      response = await fetch(PREFIX + path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
        signal: signal ? AbortSignal.any([signal, timeout]) : timeout,
      });
      // A success whose body cannot be read (cut off, or this call's timeout after the
      // headers came) is no answer: taken as null, renderStatus(null) threw a TypeError.
      data = await response.json().catch((err) => {
        if (response.ok) throw err;
        return null;
      });
    } catch (err) {
      if (signal?.aborted) throw err;
      on.lost();
      throw new Unreachable(String(err));
    }
    on.answered();
    if (!response.ok) {
      if (response.status === 401) on.refused();
      throw new ApiError(response.status, data?.error ?? `HTTP ${response.status}`, data?.field);
    }
    return data;
  };
}
