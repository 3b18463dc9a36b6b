/* Search excerpts when the site is opened from file://. Sphinx's search fetches each result's page to cut an
   excerpt from it, and a browser refuses fetch() on file://; course_site writes each page's text as a script,
   _page_text/<page>.js, which a <script> tag may load there. On http(s) nothing changes. */
(() => {
  if (window.location.protocol !== "file:") return;
  window.coursePageText = {};
  const root = document.documentElement.dataset.content_root || "";
  window.fetch = (url) => new Promise((resolve) => {
    const script = document.createElement("script");
    script.src = root + "_page_text/" + String(url).slice(root.length).replace(/\.html$/, ".js");
    script.onload = () => resolve(new Response(window.coursePageText[script.src] || ""));
    script.onerror = () => resolve(new Response(""));  // no excerpt, as Sphinx shows for an empty page
    document.head.appendChild(script);
  });
})();
