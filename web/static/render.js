// Markdown -> safe HTML for model output. The one function the page uses for every answer,
// streamed or from history: marked parses, highlight.js colours code, DOMPurify sanitises.
import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.min.js";
import hljs from "./vendor/highlight.js/highlight.min.js";

const escapeHtml = (s) =>
  s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

function highlight(code, lang, guess) {
  const name = (lang || "").match(/^[\w+#.-]*/)[0].toLowerCase();
  try {
    if (name && hljs.getLanguage(name)) {
      return { html: hljs.highlight(code, { language: name, ignoreIllegals: true }).value, name };
    }
    if (guess && code.length < 20000) {
      const auto = hljs.highlightAuto(code);
      return { html: auto.value, name: auto.language || "" };
    }
  } catch {
    // fall through to plain text
  }
  return { html: escapeHtml(code), name: "" };
}

let guessLanguage = true; // off while streaming: auto-detection on every frame is wasteful

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    code({ text, lang }) {
      const { html, name } = highlight(text, lang, guessLanguage);
      const cls = name ? ` class="hljs language-${escapeHtml(name)}"` : ' class="hljs"';
      return `<pre><code${cls}>${html}</code></pre>\n`;
    },
    // Model output never makes the browser fetch anything by itself: images become links.
    image({ href, text }) {
      return `<a href="${escapeHtml(href || "")}">${escapeHtml(text || href || "image")}</a>`;
    },
  },
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "picture", "source", "video", "audio", "iframe", "form",
    "input", "button", "textarea", "select", "option", "svg", "math", "template"],
  FORBID_ATTR: ["style", "id", "name", "srcset"],
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

/**
 * Render untrusted Markdown (model output) to sanitised HTML.
 * `streaming`: a partial answer, re-rendered often; code without a language stays uncoloured.
 */
export function renderMarkdown(text, { streaming = false } = {}) {
  guessLanguage = !streaming;
  const html = marked.parse(text || "", { async: false });
  return DOMPurify.sanitize(html, PURIFY);
}
