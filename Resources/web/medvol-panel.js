// MedVol-R1's note in the OHIF viewer that `medvol serve --monailabel` serves: the research-use
// notice, and what the last segmentation answered (found or "not found", reasoning, confidence),
// read from the X-MedVol-Result header of the worker's /infer/ replies. MONAI Label's plugin shows
// only success or failure; this says what the model said.
(function () {
  'use strict';
  var NOTICE = 'Research use only \u2014 not a medical device.';
  if (document.cookie.indexOf('MONAILABEL_SERVER_URL=') < 0) {
    document.cookie = 'MONAILABEL_SERVER_URL=' + encodeURIComponent(window.location.origin + '/') + '; path=/; SameSite=Strict';
  }
  function box() {
    var el = document.getElementById('medvol-result');
    if (el) return el;
    el = document.createElement('div');
    el.id = 'medvol-result';
    el.setAttribute('role', 'status');
    el.style.cssText = 'position:fixed;left:8px;bottom:8px;z-index:100000;max-width:420px;padding:6px 10px;' +
      'background:rgba(0,0,0,0.85);color:#fff;font:12px sans-serif;border:1px solid #5acce6;border-radius:4px;' +
      'white-space:pre-wrap;pointer-events:none';
    el.textContent = 'MedVol-R1 \u2014 ' + NOTICE;
    document.body.appendChild(el);
    return el;
  }
  function show(text) { box().textContent = 'MedVol-R1 \u2014 ' + NOTICE + '\n' + text; }
  function report(xhr) {
    var raw = xhr.getResponseHeader('X-MedVol-Result');
    if (raw) {
      var r = JSON.parse(decodeURIComponent(raw));
      var lines = [r.message];
      if (!r.absent) lines.push('segment: ' + r.label);
      if (r.confidence !== null && r.confidence !== undefined) lines.push('confidence: ' + r.confidence.toFixed(2));
      if (r.model_label) lines.push('model: ' + r.model_label);
      if (r.reasoning) lines.push('reasoning: ' + String(r.reasoning).slice(0, 300));
      show(lines.join('\n'));
      return;
    }
    if (xhr.status !== 200) {
      var detail = 'HTTP ' + xhr.status;
      try {
        var body = xhr.response instanceof ArrayBuffer ? new TextDecoder().decode(xhr.response) : xhr.responseText;
        detail = JSON.parse(body).detail || detail;
      } catch (e) { /* not JSON: keep the status */ }
      show('refused: ' + detail);
    }
  }
  var open = XMLHttpRequest.prototype.open;
  XMLHttpRequest.prototype.open = function (method, url) {
    this._medvolInfer = String(url).indexOf('/infer/') >= 0;
    return open.apply(this, arguments);
  };
  var send = XMLHttpRequest.prototype.send;
  XMLHttpRequest.prototype.send = function () {
    if (this._medvolInfer) {
      var xhr = this;
      show('segmenting\u2026');
      xhr.addEventListener('loadend', function () { try { report(xhr); } catch (e) { show('unreadable reply'); } });
    }
    return send.apply(this, arguments);
  };
  if (document.body) box(); else document.addEventListener('DOMContentLoaded', box);
})();
